"""Resuming continues exactly: callback states find their owners whatever the list, and a checkpoint written in
the middle of an epoch resumes at the next batch, giving the weights of an uninterrupted run bit for bit."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import easyfit
from easyfit.callbacks import CSVLogger, EarlyStopping, LambdaCallback, ModelCheckpoint


# --- 3. callback states by identity ----------------------------------------------------------
def test_callback_states_come_back_whatever_the_list_order_and_verbosity(make_net, classification, tmp_path):
    best = str(tmp_path / "best.pt")
    path = tmp_path / "after3.pt"
    model = easyfit.Model(make_net(), "cross_entropy", "adam", lr=0.05)
    stopping = EarlyStopping(monitor="loss", patience=50)
    checkpoint = ModelCheckpoint(best, monitor="loss", save_best_only=True)
    model.fit(*classification, epochs=3, verbose=2, callbacks=[CSVLogger(tmp_path / "log.csv"), stopping, checkpoint])
    model.save(path)
    resumed_stopping = EarlyStopping(monitor="loss", patience=50)
    resumed_checkpoint = ModelCheckpoint(best, monitor="loss", save_best_only=True)
    resumed = easyfit.Model(make_net(), "cross_entropy", "adam", lr=0.05)
    resumed.fit(*classification, epochs=3, verbose=0, resume_from=path, callbacks=[resumed_checkpoint,
                                                                                   resumed_stopping])
    assert resumed_checkpoint.best == checkpoint.best == min(model.history.history["loss"])
    assert (resumed_stopping.best, resumed_stopping.best_epoch) == (stopping.best, stopping.best_epoch)


def test_two_checkpoints_keep_their_own_best(make_net, classification, tmp_path):
    x, y = classification
    path = tmp_path / "after2.pt"

    def callbacks():
        return [ModelCheckpoint(str(tmp_path / "by_loss.pt"), monitor="loss", save_best_only=True),
                ModelCheckpoint(str(tmp_path / "by_val.pt"), monitor="val_loss", save_best_only=True)]
    first = callbacks()
    model = easyfit.Model(make_net(), "cross_entropy", "adam", lr=0.05)
    model.fit(x, y, epochs=2, validation_data=(x[:20], y[:20]), verbose=0, callbacks=first)
    model.save(path)
    second = callbacks()[::-1]
    easyfit.Model(make_net(), "cross_entropy", "adam").fit(x, y, epochs=2, validation_data=(x[:20], y[:20]),
                                                           verbose=0, resume_from=path, callbacks=second)
    assert {c.filepath: c.best for c in second} == {c.filepath: c.best for c in first}


def test_saved_states_without_an_owner_are_named_in_a_warning(make_net, classification, tmp_path):
    path = tmp_path / "after2.pt"
    model = easyfit.Model(make_net(), "cross_entropy", "adam")
    model.fit(*classification, epochs=2, verbose=0, callbacks=[EarlyStopping(monitor="loss")])
    model.save(path)
    with pytest.warns(RuntimeWarning, match=r"saved state of EarlyStopping\(monitor='loss'\)"):
        easyfit.Model(make_net(), "cross_entropy", "adam").fit(
            *classification, epochs=2, verbose=0, resume_from=path, callbacks=[EarlyStopping(monitor="val_loss")])


# --- 8. mid-epoch resume ----------------------------------------------------------------
def data_forms(x, y):
    return {
        "tensors": ((x, y), {}),
        "dataset": ((TensorDataset(x, y),), {}),
        "shuffled_loader": ((DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True),), {}),
        "list_of_batches": (([(x[i:i + 16], y[i:i + 16]) for i in range(0, len(x), 16)],), {}),
    }


def fit_with_checkpoints(make_net, data, tmp_path, epochs=3, resume_from=None, **kwargs):
    """Adam with a per-step scheduler over a net with dropout, shuffled: everything that must continue exactly."""
    net = make_net(dropout=0.3)
    model = easyfit.Model(net, "cross_entropy", "adam", lr=0.01, scheduler_interval="step",
                          scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 4, gamma=0.9))
    callbacks = [ModelCheckpoint(str(tmp_path / "ck-{epoch}-{batch}.pt"), save_freq=5)] if resume_from is None else []
    args, options = data
    torch.manual_seed(7 if resume_from is None else 99)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "resuming: no callback of this fit takes", RuntimeWarning)
        model.fit(*args, epochs=epochs, batch_size=16, seed=3, verbose=0, callbacks=callbacks,
                  resume_from=resume_from, **options, **kwargs)
    return model


@pytest.mark.parametrize("form", ["tensors", "dataset", "shuffled_loader", "list_of_batches"])
def test_resuming_a_mid_epoch_checkpoint_equals_training_straight(form, make_net, classification, tmp_path):
    data = data_forms(*classification)[form]
    straight = fit_with_checkpoints(make_net, data, tmp_path)   # 7 batches an epoch: saves after batches 5, 10, 15
    for name in ("ck-1-5.pt", "ck-2-3.pt", "ck-3-1.pt"):
        resumed = fit_with_checkpoints(make_net, data, tmp_path, resume_from=tmp_path / name)
        for key, value in straight.net.state_dict().items():
            assert torch.equal(resumed.net.state_dict()[key], value), (name, key)
        assert resumed.history.epoch == [0, 1, 2]
        assert resumed.history.history["loss"] == pytest.approx(straight.history.history["loss"], abs=1e-9)


def test_a_mid_epoch_checkpoint_on_a_one_shot_iterator_is_refused(make_net, classification, tmp_path):
    x, y = classification
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, len(x), 16)]
    fit_with_checkpoints(make_net, ((batches,), {}), tmp_path, epochs=1)
    with pytest.raises(TypeError, match="one-shot iterator") as error:
        fit_with_checkpoints(make_net, ((iter(batches),), {}), tmp_path, epochs=1,
                             resume_from=tmp_path / "ck-1-5.pt")
    assert "batch 5 of epoch 1" in str(error.value)


def test_a_checkpoint_inside_an_accumulation_window_is_refused_saying_how_to_go_on(make_net, classification,
                                                                                      tmp_path):
    path = tmp_path / "inside.pt"
    model = easyfit.Model(make_net(), "cross_entropy", "adam")
    save = LambdaCallback(on_train_batch_end=lambda batch, logs: batch == 4 and model.save(path))   # model.save
    model.fit(*classification, epochs=1, batch_size=16, gradient_accumulation_steps=2, verbose=0, callbacks=[save])
    with pytest.raises(ValueError, match="gradient_accumulation_steps") as error:
        easyfit.Model(make_net(), "cross_entropy", "adam").fit(*classification, epochs=1, batch_size=16, verbose=0,
                                                               gradient_accumulation_steps=2, resume_from=path)
    assert "after batch 5 of epoch 1" in str(error.value)
    assert "the run that wrote it had gradient_accumulation_steps=2" in str(error.value)
    assert "give BackupAndRestore a new backup_dir" in str(error.value)
