"""Per-step time of easyfit's fit on one CUDA GPU against a hand-written loop (and Lightning / Accelerate where
installed), each side in its own process, the sides interleaved in rounds.

    python benchmarks/gpu.py [--rounds 3] [--epochs 3] [--workloads mlp,resnet] [--sides hand,easyfit,...]

Workloads (data in CPU memory, each batch copied to the GPU, shuffled every epoch):
  mlp      MLP 784-512-512-10, 60,000 samples, batch 128, Adam, fp32: bound by per-step overhead
  resnet   torchvision's ResNet-18 (10 classes) on 10,000 32x32 images, batch 256, SGD, bf16-mixed: bound by compute
Every process trains one warm-up epoch and then `--epochs` timed epochs (CUDA synchronised at both ends); a side's
figure for a round is its median seconds per step. The table gives the median over rounds and the ratio to the
hand-written loop; the bar is easyfit <= 1.03x.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

SIDES = ["hand", "easyfit", "lightning", "accelerate"]
NEEDS = {"lightning": "lightning", "accelerate": "accelerate"}
BAR = 1.03
CUDA = torch.device("cuda")


def workload(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, int, str]:
    """(net, x, y, batch size, precision) of a workload, the same in every process."""
    torch.manual_seed(0)
    if name == "mlp":
        net = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        return net, torch.randn(60_000, 784), torch.randint(0, 10, (60_000,)), 128, "32"
    import torchvision
    net = torchvision.models.resnet18(num_classes=10)
    return net, torch.randn(10_000, 3, 32, 32), torch.randint(0, 10, (10_000,)), 256, "bf16-mixed"


def make_optimizer(name: str, net: nn.Module) -> torch.optim.Optimizer:
    if name == "mlp":
        return torch.optim.Adam(net.parameters(), lr=1e-3)
    return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


class EpochClock:
    """Seconds per step of each epoch, the device (CUDA unless told) synchronised at the epoch's start and end."""

    def __init__(self, steps: int, device: torch.device = CUDA):
        self.steps, self.device, self.times, self.started = steps, device, [], 0.0

    def _synchronise(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._synchronise()
        self.started = time.perf_counter()

    def stop(self) -> None:
        self._synchronise()
        self.times.append((time.perf_counter() - self.started) / self.steps)


def batch_loader(x, y, batch_size: int):
    """A DataLoader yielding whole batches by index lists (no per-sample collation), reshuffled every epoch."""
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset
    sampler = BatchSampler(RandomSampler(range(len(x))), batch_size, drop_last=False)
    return DataLoader(TensorDataset(x, y), sampler=sampler, batch_size=None)


def run_hand(name: str, epochs: int) -> list[float]:
    net, x, y, batch_size, precision = workload(name)
    net.cuda()
    optimizer = make_optimizer(name, net)
    dtype = torch.bfloat16 if precision == "bf16-mixed" else None
    clock = EpochClock(-(-len(x) // batch_size))
    for _ in range(epochs + 1):
        clock.start()
        order = torch.randperm(len(x))
        for start in range(0, len(x), batch_size):
            index = order[start:start + batch_size]
            inputs, target = x[index].cuda(non_blocking=True), y[index].cuda(non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(net(inputs), target)
            loss.backward()
            optimizer.step()
        clock.stop()
    return clock.times[1:]


def run_easyfit(name: str, epochs: int) -> list[float]:
    import easyfit
    from easyfit.callbacks import Callback
    net, x, y, batch_size, precision = workload(name)
    clock = EpochClock(-(-len(x) // batch_size))

    class Timer(Callback):
        def on_epoch_begin(self, epoch, logs=None):
            clock.start()

        def on_epoch_end(self, epoch, logs=None):
            clock.stop()
    model = easyfit.Model(net, "cross_entropy", make_optimizer(name, net))
    model.fit(x, y, epochs=epochs + 1, batch_size=batch_size, verbose=0, accelerator="gpu", devices=1,
              precision=precision, callbacks=[Timer()])
    return clock.times[1:]


def run_lightning(name: str, epochs: int) -> list[float]:
    import lightning
    net, x, y, batch_size, precision = workload(name)
    clock = EpochClock(-(-len(x) // batch_size))

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, index):
            inputs, target = batch
            return F.cross_entropy(self.net(inputs), target)

        def configure_optimizers(self):
            return make_optimizer(name, self.net)

        def on_train_epoch_start(self):
            clock.start()

        def on_train_epoch_end(self):
            clock.stop()
    trainer = lightning.Trainer(max_epochs=epochs + 1, accelerator="gpu", devices=1, precision=precision,
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False)
    trainer.fit(Module(), batch_loader(x, y, batch_size))
    return clock.times[1:]


def run_accelerate(name: str, epochs: int) -> list[float]:
    import accelerate
    net, x, y, batch_size, precision = workload(name)
    accelerator = accelerate.Accelerator(mixed_precision="bf16" if precision == "bf16-mixed" else "no")
    net, optimizer, loader = accelerator.prepare(net, make_optimizer(name, net), batch_loader(x, y, batch_size))
    clock = EpochClock(-(-len(x) // batch_size))
    for _ in range(epochs + 1):
        clock.start()
        for inputs, target in loader:
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(F.cross_entropy(net(inputs), target))
            optimizer.step()
        clock.stop()
    return clock.times[1:]


RUNNERS = {"hand": run_hand, "easyfit": run_easyfit, "lightning": run_lightning, "accelerate": run_accelerate}


def measure(side: str, name: str, epochs: int) -> float:
    """The median seconds per step of `side` on workload `name`, in a fresh process."""
    done = subprocess.run([sys.executable, __file__, "--worker", side, "--workloads", name, "--epochs", str(epochs)],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{side} on {name} failed:\n{done.stderr[-3000:]}")
    return statistics.median(json.loads(done.stdout.strip().splitlines()[-1]))


def interleaved(sides: list[str], rounds: int, measure_side) -> dict[str, list[float]]:
    """Each side's figure in each round; the order of the sides alternates from round to round, so a change in the
    machine's state hits them alike."""
    times: dict[str, list[float]] = {side: [] for side in sides}
    for round_index in range(rounds):
        for side in sides if round_index % 2 == 0 else reversed(sides):
            times[side].append(measure_side(side))
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workloads", default="mlp,resnet")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(RUNNERS[args.worker](args.workloads, args.epochs)))
        return
    sides = [side for side in args.sides.split(",") if importlib.util.find_spec(NEEDS.get(side, "torch"))]
    names = [name for name in args.workloads.split(",")
             if name != "resnet" or importlib.util.find_spec("torchvision")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; seconds per step, median of {args.rounds} "
          f"rounds x {args.epochs} epochs; ratio to the hand-written loop")
    for name in names:
        times = interleaved(sides, args.rounds, lambda side, name=name: measure(side, name, args.epochs))
        hand = statistics.median(times["hand"])
        for side in sides:
            ratios = [t / h for t, h in zip(times[side], times["hand"])]
            verdict = f"  (bar {BAR:.2f}x: {'ok' if statistics.median(ratios) <= BAR else 'OVER'})" \
                if side == "easyfit" else ""
            print(f"{name:7s} {side:11s} {statistics.median(times[side]) * 1e3:7.2f} ms  "
                  f"{statistics.median(times[side]) / hand:4.2f}x (per round {min(ratios):.2f}-{max(ratios):.2f})"
                  f"{verdict}")


if __name__ == "__main__":
    main()
