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
    return error_message(error_type, model.fit, x, y, verbose=0, **kwargs)


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


def test_int32_targets_for_cross_entropy(make_net, classification):
    x, y = classification
    message = fit_error(make_net, x.numpy(), y.int().numpy(), error_type=TypeError)
    assert "int64 class indices" in message and "int32" in message and "astype('int64')" in message


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
