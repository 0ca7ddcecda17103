"""Bad input gets an error that says what is wrong and how to fix it."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import easyfit


class EmptyDataset(Dataset):
    def __len__(self) -> int:
        return 0

    def __getitem__(self, i):
        raise IndexError(i)


def error_message(error_type, call, *args, **kwargs) -> str:
    with pytest.raises(error_type) as error:
        call(*args, **kwargs)
    return str(error.value)


def fit_error(make_net, x, y, error_type=ValueError, loss="cross_entropy", net=None, **kwargs) -> str:
    model = easyfit.Model(net or make_net(), loss, "sgd")
    return error_message(error_type, model.fit, x, y, **{"verbose": 0, **kwargs})


def test_x_and_y_of_different_lengths(make_net, classification):
    x, y = classification
    message = fit_error(make_net, x, y[:-1])
    assert "101" in message and "100" in message and "first dimension" in message


def test_unknown_loss_lists_valid_names_and_suggests_the_closest(make_net):
    message = error_message(ValueError, easyfit.Model, make_net(), "cross_entropi")
    assert "'cross_entropi'" in message and "Did you mean 'cross_entropy'?" in message
    assert all(name in message for name in ("mse", "bce_with_logits", "huber", "nll"))


def test_unknown_metric_and_optimizer_names(make_net):
    message = error_message(ValueError, easyfit.Model, make_net(), metrics=["accuracyy"])
    assert "'accuracyy'" in message and "Did you mean 'accuracy'?" in message and "auroc" in message
    message = error_message(ValueError, easyfit.Model, make_net(), optimizer="adan")
    assert "'adan'" in message and "'adam'" in message and "sgd" in message


def test_optimizer_over_another_nets_parameters(make_net):
    optimizer = torch.optim.SGD(make_net(seed=1).parameters(), lr=0.1)
    message = error_message(ValueError, easyfit.Model, make_net(), optimizer=optimizer)
    assert "do not belong to the net" in message and "net.parameters()" in message


EMPTY_CASES = [(method, data) for method in ("fit", "evaluate", "predict")
               for data in ("tensors", "dataset", "list", "generator")
               if method != "predict" or data in ("tensors", "dataset")]   # an empty iterable predicts nothing


@pytest.mark.parametrize("method, data", EMPTY_CASES)
def test_empty_data(method, data, make_net):
    args = {"tensors": (torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)), "dataset": (EmptyDataset(),),
            "list": ([],), "generator": (iter([]),)}[data]
    model = easyfit.Model(make_net())
    fit_options = {"gradient_accumulation_steps": 2} if method == "fit" else {}
    message = error_message(ValueError, getattr(model, method), *args[:1 if method == "predict" else 2], verbose=0,
                            **fit_options)
    assert "0 samples" in message or "no batches" in message
    assert "at least one sample" in message


@pytest.mark.parametrize("batch_size", [0, -1, 1.5])
@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
def test_batch_size_must_be_a_positive_integer(batch_size, method, make_net, classification):
    model = easyfit.Model(make_net())
    args = classification[:1] if method == "predict" else classification
    message = error_message(ValueError, getattr(model, method), *args, batch_size=batch_size, verbose=0)
    assert "batch_size must be a positive integer" in message and repr(batch_size) in message


@pytest.mark.parametrize("split", [1.0, -0.1, 1.5])
def test_validation_split_outside_zero_to_one(split, make_net, classification):
    message = fit_error(make_net, *classification, validation_split=split)
    assert "validation_split" in message and "[0, 1)" in message and repr(split) in message


def test_validation_split_needs_sized_data_and_excludes_validation_data(make_net, classification):
    x, y = classification
    message = fit_error(make_net, DataLoader(TensorDataset(x, y)), None, validation_split=0.2)
    assert "validation_split needs" in message and "DataLoader" in message and "validation_data" in message
    message = fit_error(make_net, x, y, validation_split=0.2, validation_data=(x, y))
    assert "either validation_data or validation_split" in message


def test_float_targets_for_cross_entropy_are_explained(make_net, classification):
    x, y = classification
    message = fit_error(make_net, x, y.float(), error_type=TypeError)
    assert "class indices" in message and "y.long()" in message and "float32" in message


@pytest.mark.parametrize("method", ["evaluate", "predict"])
def test_an_error_inside_evaluate_or_predict_leaves_the_net_in_training_mode(method, make_net, classification):
    net = make_net()
    batches = [(classification[0][:8], classification[1][:8]), ("not a tensor", None)]
    with pytest.raises(TypeError):
        getattr(easyfit.Model(net), method)(batches, verbose=0)
    assert net.training


def test_top5_accuracy_needs_five_outputs(make_net, classification):
    model = easyfit.Model(make_net(), metrics=["top5_accuracy"])
    message = error_message(ValueError, model.evaluate, *classification, verbose=0)
    assert "at least 5 outputs" in message and "has 3" in message and "'accuracy'" in message


def test_integer_targets_for_bce(make_net, classification):
    x, y = classification
    message = fit_error(make_net, x, (y[:, None] > 0).long(), error_type=TypeError, loss="bce_with_logits",
                        net=make_net(out_features=1))
    assert "float targets" in message and "y.float()" in message and "int64" in message


def test_mse_output_and_target_shapes_differ(make_net, regression):
    x, y = regression
    message = fit_error(make_net, x, y.flatten(), loss="mse", net=make_net(out_features=1))
    assert "(16, 1)" in message or "(32, 1)" in message
    assert "shape" in message and "broadcasting" in message and "y.view(-1, 1)" in message


def test_unknown_strategy_suggests_the_closest_and_lists_the_valid_ones(make_net, classification):
    message = fit_error(make_net, *classification, strategy="dpp")
    assert "'dpp'" in message and "'ddp'" in message and "single" in message and "ddp_spawn" in message


def test_unknown_accelerator_suggests_the_closest_and_lists_the_valid_ones(make_net, classification):
    message = fit_error(make_net, *classification, accelerator="cpuu")
    assert "'cpuu'" in message and "'cpu'" in message and "auto" in message and "cuda" in message


def test_resume_from_a_missing_file(make_net, classification, tmp_path):
    message = fit_error(make_net, *classification, error_type=FileNotFoundError, resume_from=tmp_path / "none.pt")
    assert "none.pt" in message and "does not exist" in message


@pytest.mark.parametrize("content", ["state_dict", "text"])
def test_resume_from_a_file_that_is_not_an_easyfit_checkpoint(content, make_net, classification, tmp_path):
    path = tmp_path / "other.pt"
    if content == "state_dict":
        torch.save(make_net().state_dict(), path)
    else:
        path.write_text("not a checkpoint")
    message = fit_error(make_net, *classification, resume_from=path)
    assert "other.pt" in message and "is not an easyfit checkpoint" in message


def test_load_needs_the_optimizer_when_it_has_no_name(make_net, tmp_path):
    class CustomSGD(torch.optim.SGD):
        pass
    net = make_net()
    easyfit.Model(net, optimizer=CustomSGD(net.parameters(), lr=0.1)).save(tmp_path / "custom.pt")
    message = error_message(ValueError, easyfit.Model.load, tmp_path / "custom.pt", net=make_net())
    assert "custom.pt" in message and "optimizer=" in message


def test_unexpected_fit_argument_is_named_with_a_suggestion(make_net, classification):
    message = fit_error(make_net, *classification, error_type=TypeError, epoch=3)
    assert "unexpected argument(s) epoch" in message and "'epochs'" in message and "batch_size" in message


def test_net_must_be_a_module():
    message = error_message(TypeError, easyfit.Model, lambda x: x)
    assert "torch.nn.Module" in message
    assert "scheduler_interval" in error_message(ValueError, easyfit.Model, nn.Linear(2, 2), scheduler_interval="x")


# --- arguments that used to fail deep inside torch, or be ignored -------------------------------------
def test_a_loss_class_instead_of_an_instance(make_net):
    message = error_message(TypeError, easyfit.Model, make_net(), nn.CrossEntropyLoss)
    assert "loss=CrossEntropyLoss is a class" in message and "loss=CrossEntropyLoss()" in message


def test_validation_data_as_a_list_is_accepted(make_net, classification):
    x, y = classification
    history = easyfit.Model(make_net(), optimizer="sgd").fit(x, y, validation_data=[x, y], verbose=0)
    assert len(history.history["val_loss"]) == 1


def test_validation_data_as_a_list_with_sample_weights_is_accepted(make_net, classification):
    x, y = classification
    weights = torch.ones(len(x))
    weights[::2] = 0.0
    as_list = easyfit.Model(make_net(), optimizer="sgd").fit(x, y, validation_data=[x, y, weights], verbose=0)
    as_tuple = easyfit.Model(make_net(), optimizer="sgd").fit(x, y, validation_data=(x, y, weights), verbose=0)
    unweighted = easyfit.Model(make_net(), optimizer="sgd").fit(x, y, validation_data=(x, y), verbose=0)
    assert as_list.history["val_loss"] == as_tuple.history["val_loss"] != unweighted.history["val_loss"]


@pytest.mark.parametrize("option, value, error_type, words", [
    ("validation_freq", 0, ValueError, "validation_freq must be a positive integer, got 0"),
    ("verbose", "yes", ValueError, ("verbose must be 0 (silent), 1 (a progress bar), 2 (one line per epoch) or "
                                    "'auto', got 'yes'")),
    ("verbose", 3, ValueError, "got 3"),
    ("shuffle", "no", TypeError, "shuffle must be True or False, got 'no'"),
    ("callbacks", [easyfit.callbacks.EarlyStopping], TypeError,
     "callbacks holds the class EarlyStopping; pass an instance: EarlyStopping(...)"),
    ("callbacks", [print], TypeError, "callbacks must be easyfit.callbacks.Callback instances"),
])
def test_fit_options_of_the_wrong_kind(option, value, error_type, words, make_net, classification):
    assert words in fit_error(make_net, *classification, error_type=error_type, **{option: value})


@pytest.mark.parametrize("method", ["evaluate", "predict"])
def test_evaluate_and_predict_check_verbose_and_callbacks(method, make_net, classification):
    model = easyfit.Model(make_net())
    data = classification[:1] if method == "predict" else classification
    assert "got 'yes'" in error_message(ValueError, getattr(model, method), *data, verbose="yes")
    assert "pass an instance" in error_message(TypeError, getattr(model, method), *data, verbose=0,
                                               callbacks=easyfit.callbacks.Callback)


def test_a_single_callback_is_accepted(make_net, classification):
    class Epochs(easyfit.callbacks.Callback):
        epochs = 0

        def on_epoch_end(self, epoch, logs=None):
            self.epochs += 1
    epochs = Epochs()
    easyfit.Model(make_net(), optimizer="sgd").fit(*classification, epochs=2, verbose=0, callbacks=epochs)
    assert epochs.epochs == 2


def test_a_metric_class_instead_of_an_instance(make_net):
    torchmetrics = pytest.importorskip("torchmetrics")
    message = error_message(TypeError, easyfit.Model, make_net(), metrics=[torchmetrics.Accuracy])
    assert "metrics holds the class Accuracy; pass an instance" in message and "'accuracy'" in message


@pytest.mark.parametrize("optimizer", ["instance", "factory"])
def test_lr_beside_an_optimizer_that_sets_its_own(optimizer, make_net):
    net = make_net()
    given = torch.optim.SGD(net.parameters(), lr=0.5) if optimizer == "instance" else \
        (lambda params: torch.optim.SGD(params, lr=0.5))
    message = error_message(ValueError, easyfit.Model, net, optimizer=given, lr=0.1)
    assert "lr=0.1 applies only to an optimizer given by name" in message and "optimizer='sgd', lr=0.1" in message


def test_load_restores_an_optimizer_with_two_parameter_groups(make_net, classification, tmp_path):
    net = make_net()
    groups = [{"params": net[0].parameters()}, {"params": net[2].parameters(), "lr": 1e-4}]
    model = easyfit.Model(net, optimizer=torch.optim.Adam(groups, lr=1e-3))
    model.fit(*classification, verbose=0)
    model.save(tmp_path / "groups.pt")
    loaded = easyfit.Model.load(tmp_path / "groups.pt", net=make_net(seed=1))
    assert [group["lr"] for group in loaded.optimizer.param_groups] == [1e-3, 1e-4]
    assert str(loaded.optimizer.state_dict()) == str(model.optimizer.state_dict())


@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
def test_a_file_name_as_data(method, make_net):
    model = easyfit.Model(make_net())
    message = error_message(TypeError, getattr(model, method), "data.csv", verbose=0)
    assert "x is a str ('data.csv')" in message and "reads no files" in message and "read_csv" in message


def test_strategy_none_means_auto(make_net, classification):
    easyfit.Model(make_net(), optimizer="sgd").fit(*classification, strategy=None, verbose=0)
