"""TensorBoard: epoch (and optionally batch) scalars, the net's graph and weight histograms for TensorBoard.

Needs the tensorboard package (pip install easyfit[tensorboard]); it is imported only when training starts."""
from __future__ import annotations

import importlib.util
import os

import torch

from easyfit.callbacks.base import Callback


class TensorBoard(Callback):
    """Write logs that `tensorboard --logdir <log_dir>` shows, with torch's SummaryWriter, on global rank 0.

    Training values go to `<log_dir>/train` and validation values to `<log_dir>/validation`, both named
    `epoch_<name>` (so train and validation loss share one chart), at the epoch number.

    Args:
        log_dir: the folder to write to.
        histogram_freq: every this many epochs, a histogram of each parameter (0: none).
        write_graph: the net's graph, traced once on the first training batch's input (in eval mode, without
            touching the random-number state, so training is unchanged).
        update_freq: "epoch"; "batch" or an integer N: also `batch_loss` every N training batches (reading a
            batch's loss waits for the device, so a large N costs less).
    """

    def __init__(self, log_dir: str | os.PathLike = "logs", histogram_freq: int = 0, write_graph: bool = True,
                 update_freq: str | int = "epoch"):
        if importlib.util.find_spec("tensorboard") is None:
            raise ImportError("the TensorBoard callback needs the tensorboard package: "
                              "pip install easyfit[tensorboard]")
        if update_freq not in ("epoch", "batch") and (isinstance(update_freq, bool) or not isinstance(update_freq, int)
                                                      or update_freq < 1):
            raise ValueError(f"TensorBoard: update_freq must be 'epoch', 'batch' or a positive number of batches, "
                             f"got {update_freq!r}")
        self.log_dir, self.histogram_freq, self.write_graph = os.fspath(log_dir), histogram_freq, write_graph
        self.update_freq = 1 if update_freq == "batch" else update_freq
        self.writers: dict = {}
        self.step = 0
        self.graph_hook = None

    def on_train_begin(self, logs=None):
        if not self.model.is_global_zero:
            return
        from torch.utils.tensorboard import SummaryWriter
        self.writers = {part: SummaryWriter(os.path.join(self.log_dir, part)) for part in ("train", "validation")}
        self.step = self.model.completed_epochs * (self.params.get("steps_per_epoch") or 0)
        if self.write_graph:
            self.graph_hook = self.model.net.register_forward_pre_hook(self._write_graph)

    def _write_graph(self, net: torch.nn.Module, inputs: tuple) -> None:
        """Forward pre-hook, first batch only: trace the net on a detached copy of its input."""
        self.graph_hook.remove()
        self.graph_hook = None
        example = tuple(item.detach() if isinstance(item, torch.Tensor) else item for item in inputs)
        was_training = net.training
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            net.eval()
            try:
                self.writers["train"].add_graph(net, example if len(example) != 1 else example[0])
            finally:
                net.train(was_training)

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.writers and self.update_freq != "epoch" and self.step % self.update_freq == 0:
            self.writers["train"].add_scalar("batch_loss", logs["batch_loss"], self.step)

    def on_epoch_end(self, epoch, logs=None):
        if not self.writers:
            return
        for key, value in (logs or {}).items():
            if isinstance(value, (int, float)):
                validation = key.startswith("val_")
                name = f"epoch_{key[4:] if validation else key}"
                self.writers["validation" if validation else "train"].add_scalar(name, value, epoch)
        if self.histogram_freq and (epoch + 1) % self.histogram_freq == 0:
            for name, parameter in self.model.net.named_parameters():
                self.writers["train"].add_histogram(name, parameter.detach().cpu(), epoch)
        for writer in self.writers.values():
            writer.flush()

    def on_train_end(self, logs=None):
        if self.graph_hook is not None:
            self.graph_hook.remove()
            self.graph_hook = None
        for writer in self.writers.values():
            writer.close()
        self.writers = {}
