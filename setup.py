"""Packaging for easyfit."""
from setuptools import find_packages, setup

EXTRAS = {
    "deepspeed": ["deepspeed>=0.14"],
    "fairscale": ["fairscale>=0.4.13"],
    "horovod": ["horovod==0.28.1", "cloudpickle", "psutil"],   # build it first: scripts/install_horovod.sh
    "bagua": ["bagua>=0.9"],
    # torch_xla 2.9.0 requires exactly torch 2.9.0 (docs/tpu.md); on a TPU VM add torch_xla[tpu] for libtpu
    "xla": ["torch==2.9.0", "torch_xla==2.9.0"],
    "plot": ["matplotlib>=3.5"],
    "tensorboard": ["tensorboard>=2.10"],
    "mlflow": ["mlflow>=3.0"],
    "wandb": ["wandb>=0.19"],
    "optuna": ["optuna>=4.0"],
    # launcher="ray": Ray Train's TorchTrainer, Ray Data as a batch source, Ray Tune (docs/ray.md)
    "ray": ["ray[train,tune,data]>=2.50"],
    # Hugging Face models, datasets and tokenizers (loss="model", a datasets.Dataset, examples/finetune_text.py)
    "hf": ["transformers>=4.46", "datasets>=2.19", "tokenizers>=0.19"],
    # model.export: ONNX files (torch.onnx's exporter, and onnxruntime to run them); .pt2 files need torch alone
    "export": ["onnx>=1.17", "onnxscript>=0.3", "onnxruntime>=1.20"],
    # save_weights / load_weights of *.safetensors files
    "safetensors": ["safetensors>=0.4"],
    # what the examples need besides easyfit (the README's quickstart line installs only this)
    "examples": ["scikit-learn>=1.2", "matplotlib>=3.5"],
}
EXTRAS["dev"] = [
    "ruff>=0.5", "pytest>=7", "pytest-timeout>=2", "pytest-xdist>=3", "tensorboard>=2.10",   # xdist: one worker a core
    "nbclient>=0.7", "ipykernel>=6", "nbformat>=5",   # nbclient and ipykernel run the course notebooks
    "mlflow>=3.0", "wandb>=0.19", "optuna>=4.0",   # the callbacks around the fit, tested for real
    "torchmetrics>=1.0",   # a user's metric objects, and the numbers the named metrics are compared with
    "jedi>=0.19",   # what an editor completes in a call, read from the source (tests/test_signatures.py)
    *EXTRAS["examples"], *EXTRAS["hf"],   # the examples and the Hugging Face paths, tested too
    *EXTRAS["export"], *EXTRAS["safetensors"],   # ONNX and .pt2 export, safetensors weight files
    *EXTRAS["ray"],   # launcher="ray" on a local Ray cluster the tests start
]

setup(
    name="easyfit",
    version="0.1.0",
    description="Keras-style fit / evaluate / predict for any torch.nn.Module, from one CPU to many GPUs",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["easyfit", "easyfit.*"]),
    python_requires=">=3.10",   # the oldest Python torch 2.9 (the torch floor) supports
    install_requires=["torch>=2.9", "tqdm>=4.60", "numpy"],
    extras_require=EXTRAS,
)
