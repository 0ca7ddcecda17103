"""Every everyday feature on a CUDA device, under one device and under NCCL DDP at world size 1 (where every
collective refuses a CPU tensor), against the same fit on the CPU. Skipped without a GPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from nets import tiny_net
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import easyfit
from easyfit.callbacks import (
    BackupAndRestore,
    CSVLogger,
    EarlyStopping,
    ModelCheckpoint,
    ReduceLROnPlateau,
    TensorBoard,
)

pytestmark = pytest.mark.gpu

WHERE = ["cuda", "nccl"]


def placement(where: str) -> dict:
    """fit's keywords for a run on the CPU, one CUDA device, or NCCL DDP with one process."""
    if where == "cpu":
        return {"accelerator": "cpu", "devices": 1}
    strategy = easyfit.strategies.DDP(process_group_backend="nccl") if where == "nccl" else "single"
    return {"accelerator": "gpu", "devices": 1, "strategy": strategy}


def task_data(task: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(x, y, the Model's keywords) for one kind of task, on 101 samples."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(101, 4, generator=generator)
    if task == "multiclass":
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
        return x, y, {"out": 3, "loss": "cross_entropy", "metrics": ["accuracy", "f1", "precision"]}
    if task == "binary":
        return x, (x[:, :1] > 0).float(), {"out": 1, "loss": "bce_with_logits", "metrics": ["accuracy", "auroc"]}
    if task == "multilabel":
        y = torch.stack([x[:, 0] > 0, x[:, 1] > 0, x[:, 2] > 0.5], dim=1).float()
        return x, y, {"out": 3, "loss": "bce_with_logits", "metrics": ["accuracy"]}
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [0.0]]), {"out": 1, "loss": "mse", "metrics": ["mae", "r2"]}


def everyday_fit(task: str, where: str, tmp_path) -> dict:
    """A fit with weights, warmup, accumulation, clipping and the usual callbacks; what it produced, on the CPU."""
    x, y, spec = task_data(task)
    net = tiny_net(out_features=spec["out"])
    model = easyfit.Model(net, spec["loss"], "adam", metrics=spec["metrics"], lr=0.02)
    weights = {"class_weight": {0: 2.0, 1: 0.5}} if task == "multiclass" \
        else {"sample_weight": np.linspace(0.5, 1.5, 101)}
    folder = tmp_path / where
    folder.mkdir(exist_ok=True)
    callbacks = [EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True),
                 ReduceLROnPlateau(monitor="val_loss", patience=1, factor=0.5),
                 ModelCheckpoint(str(folder / "best.pt"), monitor="val_loss", save_best_only=True),
                 CSVLogger(str(folder / "log.csv")), TensorBoard(folder / "tb")]
    history = model.fit(x, y, epochs=5, batch_size=16, validation_split=0.2, lr_warmup_epochs=1,
                        gradient_accumulation_steps=2, gradient_clip_val=0.5, callbacks=callbacks, verbose=0,
                        seed=3, **weights, **placement(where))
    scores = model.evaluate(x, y, verbose=0, return_dict=True, **placement(where))
    predictions = model.predict(x, **placement(where))
    reloaded = easyfit.Model.load(folder / "best.pt", net=tiny_net(out_features=spec["out"], seed=9))
    return {"history": history.history, "scores": scores, "predictions": predictions.cpu(),
            "weights": {k: v.cpu() for k, v in net.state_dict().items()},
            "checkpoint_predictions": reloaded.predict(x, **placement(where)).cpu()}


def assert_same_run(actual: dict, expected: dict, atol: float) -> None:
    for key, values in expected["history"].items():
        assert actual["history"][key] == pytest.approx(values, abs=atol), key
    assert actual["scores"] == pytest.approx(expected["scores"], abs=atol)
    for key in ("predictions", "checkpoint_predictions"):
        torch.testing.assert_close(actual[key], expected[key], atol=atol, rtol=0)
    torch.testing.assert_close(actual["weights"], expected["weights"], atol=atol, rtol=0)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("task", ["multiclass", "binary", "multilabel", "regression"])
def test_everyday_fit_on_cuda_gives_the_numbers_of_the_cpu(task, where, tmp_path):
    result = everyday_fit(task, where, tmp_path)
    assert result["predictions"].shape[0] == 101
    assert_same_run(result, everyday_fit(task, "cpu", tmp_path), atol=1e-4)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_with_clipping_and_accumulation_under_nccl_equals_one_device(precision, tmp_path):
    x, y, _ = task_data("multiclass")
    results = []
    for where in WHERE:
        net = tiny_net()
        model = easyfit.Model(net, "cross_entropy", "adam", metrics=["accuracy"], lr=0.01)
        history = model.fit(x, y, epochs=4, batch_size=16, precision=precision, gradient_clip_val=0.5,
                            gradient_accumulation_steps=2, verbose=0, **placement(where))
        assert history.history["loss"][-1] < history.history["loss"][0]
        model.save(tmp_path / f"{where}.pt")
        results.append(({k: v.cpu() for k, v in net.state_dict().items()}, history.history))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=0)
    assert results[0][1]["loss"] == pytest.approx(results[1][1]["loss"], abs=1e-5)


def dropout_fit(where: str, tmp_path, epochs: int = 3, resume_from=None, callbacks=()) -> easyfit.Model:
    """Adam, a per-step scheduler and dropout (CUDA's RNG): everything a resume must continue exactly."""
    x, y, _ = task_data("multiclass")
    model = easyfit.Model(tiny_net(dropout=0.3), "cross_entropy", "adam", lr=0.01, scheduler_interval="step",
                          scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 4, gamma=0.9))
    torch.manual_seed(7 if resume_from is None else 99)
    model.fit(x, y, epochs=epochs, batch_size=16, seed=3, verbose=0, resume_from=resume_from,
              callbacks=list(callbacks), **placement(where))
    return model


@pytest.mark.parametrize("where", WHERE)
def test_resume_from_a_cuda_checkpoint_mid_epoch_and_at_an_epoch_end_equals_training_straight(where, tmp_path):
    straight = dropout_fit(where, tmp_path, callbacks=[ModelCheckpoint(str(tmp_path / "ck-{epoch}-{batch}.pt"),
                                                                       save_freq=5)])
    for name in ("ck-1-5.pt", "ck-2-3.pt"):
        with pytest.warns(RuntimeWarning, match="no callback of this fit takes"):
            resumed = dropout_fit(where, tmp_path, resume_from=tmp_path / name)
        torch.testing.assert_close(resumed.net.state_dict(), straight.net.state_dict(), atol=1e-6, rtol=0)
        assert resumed.history.epoch == [0, 1, 2]


class CrashOnce(easyfit.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.armed = True

    def on_epoch_end(self, epoch, logs=None):
        if self.armed and epoch == 1:
            self.armed = False
            raise RuntimeError("simulated crash")


@pytest.mark.parametrize("where", WHERE)
def test_backup_and_restore_after_a_crash_on_cuda_equals_an_uninterrupted_fit(where, tmp_path):
    straight = dropout_fit(where, tmp_path, epochs=4)
    crash = CrashOnce()
    with pytest.raises(RuntimeError, match="simulated crash"):
        dropout_fit(where, tmp_path, epochs=4, callbacks=[BackupAndRestore(tmp_path / "backup"), crash])
    restarted = dropout_fit(where, tmp_path, epochs=4, callbacks=[BackupAndRestore(tmp_path / "backup"), crash])
    torch.testing.assert_close(restarted.net.state_dict(), straight.net.state_dict(), atol=1e-6, rtol=0)
    assert restarted.history.epoch == [0, 1, 2, 3]


class Stream(IterableDataset):
    """An iterable dataset of (x, y) samples."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        return iter(zip(self.x, self.y))


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = tiny_net(in_features=6)

    def forward(self, features, extra):
        return self.net(torch.cat([features, extra], dim=1))


def data_forms_fit(where: str) -> dict:
    """Iterable, dict and two-input batches, and the on_batch calls; every number they produced, on the CPU."""
    x, y, _ = task_data("multiclass")
    extra = torch.randn(101, 2, generator=torch.Generator().manual_seed(1))
    results = {}
    for form in ("iterable", "dict", "two_inputs"):
        net = TwoInputs() if form != "iterable" else tiny_net()
        model = easyfit.Model(net, "cross_entropy", "sgd", metrics=["accuracy"], lr=0.1)
        if form == "iterable":
            data = (DataLoader(Stream(x, y), batch_size=16),)
        elif form == "dict":
            data = ([{"features": x[i:i + 16], "extra": extra[i:i + 16], "y": y[i:i + 16]}
                     for i in range(0, 101, 16)],)
        else:
            data = (DataLoader(TensorDataset(x, extra, y), batch_size=16),)
        history = model.fit(*data, epochs=2, verbose=0, **placement(where))
        results[form] = (history.history["loss"], model.evaluate(*data, verbose=0, **placement(where)))
    on_batch = easyfit.Model(tiny_net(), "cross_entropy", "sgd", metrics=["accuracy"], lr=0.1)
    results["train_on_batch"] = [on_batch.train_on_batch(x[:32], y[:32], **placement(where)) for _ in range(3)]
    results["test_on_batch"] = on_batch.test_on_batch(x, y, **placement(where))
    results["predict_on_batch"] = on_batch.predict_on_batch(x, **placement(where)).cpu()
    return results


@pytest.mark.parametrize("where", WHERE)
def test_iterable_dict_and_multi_input_batches_and_on_batch_calls_on_cuda(where):
    actual, expected = data_forms_fit(where), data_forms_fit("cpu")
    for key, value in expected.items():
        assert np.allclose(flat(actual[key]), flat(value), atol=1e-5), key


def flat(value) -> list[float]:
    """Every number in nested lists / tuples / tensors, in order."""
    if isinstance(value, torch.Tensor):
        return value.flatten().tolist()
    if isinstance(value, (list, tuple)):
        return [number for item in value for number in flat(item)]
    return [float(value)]
