"""Image classification as a course teaches it: torchvision's transforms (v2) with augmentation, a small CNN, one
`fit` with validation, the learning curves, and the trained net exported to ONNX for serving.

The images are made in memory (stripes across, stripes down, and a checkerboard, with noise), so it runs offline in
seconds. Swap in your own: `torchvision.datasets.ImageFolder("photos/train", transform=train_transform)`.

    pip install easyfit[export,plot] torchvision
    python examples/vision.py [--out FOLDER]
"""
import argparse
import os

import torch
from torch import nn
from torch.utils.data import Dataset
from torchvision.transforms import v2

import easyfit

SIZE, CLASSES = 24, ("across", "down", "checker")


def make_images(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` RGB images (uint8, 3 × SIZE × SIZE) of the three patterns, and their labels."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(CLASSES), (count,), generator=generator)
    rows, cols = torch.arange(SIZE).view(-1, 1), torch.arange(SIZE).view(1, -1)
    patterns = torch.stack([(rows // 3 % 2).expand(SIZE, SIZE), (cols // 3 % 2).expand(SIZE, SIZE),
                            (rows // 3 + cols // 3) % 2]).float()
    colours = torch.rand(count, 3, 1, 1, generator=generator) * 0.5 + 0.5
    noise = torch.rand(count, 3, SIZE, SIZE, generator=generator) * 0.4
    images = patterns[labels].unsqueeze(1) * colours * 0.6 + noise
    return (images.clamp(0, 1) * 255).to(torch.uint8), labels


class Images(Dataset):
    """Images and labels, each image passed through `transform` when read (as ImageFolder does)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.transform(self.images[index]), self.labels[index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="where the curves and the ONNX file go")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)

    # augmentation for training only; both end as normalised float tensors
    train_transform = v2.Compose([v2.RandomCrop(SIZE, padding=2), v2.RandomHorizontalFlip(),
                                  v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.25] * 3)])
    eval_transform = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.25] * 3)])
    train = Images(*make_images(320, seed=0), train_transform)
    val = Images(*make_images(96, seed=1), eval_transform)
    test = Images(*make_images(96, seed=2), eval_transform)

    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, len(CLASSES)))
    model = easyfit.Model(net, loss="cross_entropy", optimizer="adam", lr=3e-3, metrics=["accuracy"])
    model.summary(input_example=torch.zeros(1, 3, SIZE, SIZE))
    # num_workers=2 reads the batches in two loader processes; devices=2 would train on two processes
    history = model.fit(train, validation_data=val, epochs=args.epochs, batch_size=32, verbose=2)
    history.plot(os.path.join(args.out, "vision_curves.png"))

    loss, accuracy = model.evaluate(test, verbose=0)
    print(f"test accuracy: {accuracy:.3f}")

    # the trained net as an ONNX file, traced on the first test batch: serve it with onnxruntime, no easyfit needed
    path = os.path.join(args.out, "vision_cnn.onnx")
    model.export(path)
    import onnxruntime
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    images = torch.stack([test[i][0] for i in range(8)])
    served = session.run(None, {session.get_inputs()[0].name: images.numpy()})[0]
    predicted = model.predict(images)
    print(f"exported to {path}: its outputs match predict's to {abs(served - predicted.numpy()).max():.1e}")
    print("predicted classes:", [CLASSES[i] for i in served.argmax(1)])


if __name__ == "__main__":
    main()
