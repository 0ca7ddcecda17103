"""Ray Data as a batch source, and `model.fit` inside a user's own Ray Train `TorchTrainer`, on a real local Ray cluster
(the session's, tests/ray_cluster.py): a Dataset fits, evaluates exactly and predicts in order as the same data given as
tensors does; a fit in a user's train function joins the process group Ray made, as under torchrun."""
from __future__ import annotations

import pytest
import torch
from ray_common import LR, assert_like_plain, make_data, make_net, on_the_cluster, plain_fit

import easyfit

pytestmark = pytest.mark.timeout(600)
ROWS, ODD_ROWS = 40, 37


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    yield from on_the_cluster(__name__, ray_cluster)


def items(x, y) -> list[dict]:
    return [{"x": inputs.numpy(), "y": target.numpy()} for inputs, target in zip(x, y)]


def model():
    return easyfit.Model(make_net(), loss="mse", optimizer="sgd", lr=LR)


def user_train_function(config: dict) -> None:
    """A user's own train function: easyfit's fit, evaluate and predict in a Ray Train worker (the Ray Datasets are
    made by the driver: in a worker, Ray Data would wait for a CPU the workers hold)."""
    import ray.train
    import torch.distributed as dist
    x, y = make_data(ROWS)
    group = dist.group.WORLD
    fitted = model()
    history = fitted.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, lr_scaling=None, strategy="ddp")
    scores = fitted.evaluate(config["evaluated"], batch_size=5, verbose=0, strategy="ddp")
    predicted = fitted.predict(config["predicted"], batch_size=5, strategy="ddp")
    same_group = dist.is_initialized() and dist.group.WORLD is group and fitted.world_size == 2
    if ray.train.get_context().get_world_rank() == 0:
        torch.save({"history": history.history, "weights": fitted.net.state_dict(), "scores": scores,
                    "predicted": predicted, "same_group": same_group}, config["out"])


def test_fit_evaluate_predict_inside_a_users_torch_trainer_join_rays_process_group(cluster, tmp_path):
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    out = tmp_path / "rank0.pt"
    x_odd, y_odd = make_data(ODD_ROWS)
    datasets = {"evaluated": ray.data.from_items(items(x_odd, y_odd)), "predicted": ray.data.from_numpy(x_odd.numpy())}
    TorchTrainer(user_train_function, train_loop_config={"out": str(out), **datasets},
                 scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(storage_path=str(tmp_path), name="users-own")).fit()
    result = torch.load(out, weights_only=False)
    assert result["same_group"]
    x, y = make_data(ROWS)
    expected_losses, expected_weights = plain_fit(x, y, 16, epochs=2)
    assert result["history"]["loss"] == pytest.approx(expected_losses, abs=1e-5)
    for name, value in result["weights"].items():
        torch.testing.assert_close(value, expected_weights[name], atol=1e-5, rtol=0)
    trained = model()
    trained.net.load_state_dict(result["weights"])
    assert result["scores"] == pytest.approx(trained.evaluate(x_odd, y_odd, verbose=0), abs=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(result["predicted"], trained.net(x_odd), atol=1e-6, rtol=0)


def test_a_ray_dataset_fits_as_the_same_tensors_and_predicts_in_order_under_launcher_ray(cluster, tmp_path):
    """One batch a worker an epoch: the combined batch is every row, however Ray Train splits them."""
    import ray
    x, y = make_data(ROWS)
    x_odd, y_odd = make_data(ODD_ROWS)
    launcher = easyfit.launchers.Ray(storage_path=str(tmp_path))
    fitted = model()
    history = fitted.fit(ray.data.from_items(items(x, y)), batch_size=ROWS // 2, epochs=3, verbose=0,
                         lr_scaling=None, devices=2, strategy="ddp", launcher=launcher,
                         validation_data=ray.data.from_items(items(x_odd, y_odd)), validation_batch_size=5)
    assert_like_plain(history, fitted.net, plain_fit(x, y, ROWS))
    # validation on a Ray Dataset is exact: each epoch's val_loss is the trained net's mean over all 37 rows
    after_epoch = [plain_fit(x, y, ROWS, epochs=epochs)[1] for epochs in (1, 2, 3)]
    assert history.history["val_loss"] == pytest.approx([mse(weights, x_odd, y_odd) for weights in after_epoch],
                                                         abs=1e-6)
    predicted = fitted.predict(ray.data.from_numpy(x_odd.numpy()), batch_size=5, devices=2, strategy="ddp",
                               launcher=launcher)
    with torch.no_grad():
        torch.testing.assert_close(predicted, fitted.net(x_odd), atol=1e-6, rtol=0)


def mse(weights: dict, x, y) -> float:
    net = make_net()
    net.load_state_dict(weights)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(net(x), y))


def test_a_ray_dataset_in_one_process_equals_the_same_tensors(cluster):
    import ray
    x, y = make_data(ODD_ROWS)
    fitted = model()
    history = fitted.fit(ray.data.from_items(items(x, y)), batch_size=8, epochs=2, verbose=0)
    assert_like_plain(history, fitted.net, plain_fit(x, y, 8, epochs=2))
    assert fitted.evaluate(ray.data.from_items(items(x, y)), verbose=0) == \
        pytest.approx(fitted.evaluate(x, y, verbose=0), abs=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(fitted.predict(ray.data.from_numpy(x.numpy())), fitted.net(x), atol=1e-6, rtol=0)
