"""DDP communication options on 2 CPU processes (gloo): compressed gradients (fp16, PowerSGD) and periodic model
averaging (post-local SGD), against plain PyTorch; bf16 needs NCCL and is refused on gloo before training. The
trained cases run one after the other in one launch that the tests share (starting ranks is most of a case's cost)."""
from __future__ import annotations

import pytest
import torch
from runner import assert_same_weights, make_data, make_net, reference_weights, run_script

import easyfit
from easyfit.distributed.connector import connect
from easyfit.distributed.strategies.ddp import DDPStrategy

pytestmark = pytest.mark.timeout(300)

#: fp16 rounds each gradient to 11 significant bits (relative error <= 2**-11) before the all-reduce; over 8 SGD
#: steps at lr 0.1 the weights stay within this of full-precision DDP (measured: 1.4e-5)
FP16_TOLERANCE = 1e-4


#: the cases of tests/distributed/scripts/ddp_comm_train.py, all run in one launch that the tests share
CASES = ("fp16", "powersgd", "averaging", "averaging_resumed", "averaging_warmup")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(OUT, {case: [rank 0's result, rank 1's]}) of the one launch of every case."""
    out = tmp_path_factory.mktemp("ddp_comm")
    process = run_script(out, *CASES, script="ddp_comm_train.py", timeout=400)
    assert process.returncode == 0, process.stderr[-4000:]
    return out, {case: [torch.load(out / f"{case}-rank-{rank}.pt") for rank in (0, 1)] for case in CASES}


def local_sgd_reference(period: int, epochs: int = 2, batch: int = 16, lr: float = 0.1,
                        resumed_after: int | None = None) -> list[torch.Tensor]:
    """Plain PyTorch: two replicas, each stepping on its rank's share of every combined batch (rank r takes samples
    r, r + 2, ...), parameters averaged after steps 1, 1 + period, 1 + 2 * period, ... (torch's PeriodicModelAverager
    averages when its 0-based step count divides by the period). `resumed_after`: after that step both replicas
    continue from rank 0's weights, as a resumed run does from its checkpoint. Rank 0's parameters after each step."""
    x, y = make_data()
    replicas = [make_net() for _ in range(2)]
    optimizers = [torch.optim.SGD(net.parameters(), lr=lr) for net in replicas]
    history, step = [], 0
    for _ in range(epochs):
        for start in range(0, len(x), 2 * batch):
            for rank, (net, optimizer) in enumerate(zip(replicas, optimizers)):
                index = torch.arange(start + rank, start + 2 * batch, 2)
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(net(x[index]), y[index]).backward()
                optimizer.step()
            with torch.no_grad():
                if step % period == 0:
                    for first, second in zip(replicas[0].parameters(), replicas[1].parameters()):
                        mean = (first + second) / 2
                        first.copy_(mean)
                        second.copy_(mean)
                step += 1
                if step == resumed_after:
                    replicas[1].load_state_dict(replicas[0].state_dict())
            history.append(torch.cat([p.detach().flatten().clone() for p in replicas[0].parameters()]))
    return history


def test_fp16_compression_trains_within_tolerance_of_plain_ddp(runs):
    ranks = runs[1]["fp16"]
    expected = reference_weights(0.1)
    difference = max((ranks[0]["state"][name] - value).abs().max().item() for name, value in expected.items())
    print(f"max |fp16 - fp32| = {difference:.2e}")
    assert difference <= FP16_TOLERANCE
    assert difference > 0, "fp16 compression was not applied"
    assert_same_weights(ranks[1]["state"], ranks[0]["state"], atol=0)


def test_powersgd_trains_keeps_ranks_equal_and_resumes(runs):
    ranks = runs[1]["powersgd"]
    losses = ranks[0]["history"]["loss"]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert_same_weights(ranks[1]["state"], ranks[0]["state"], atol=0)
    # rank 1 compresses the same gradients: every step leaves both ranks with the same weights
    for first, second in zip(ranks[0]["snapshots"], ranks[1]["snapshots"]):
        torch.testing.assert_close(first, second, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["powersgd", "averaging_warmup"])
def test_a_resumed_fit_continues_the_communication_hook_exactly(runs, case):
    """1 epoch saved by ModelCheckpoint + a resumed fit equals the straight fit (both in one launch): the checkpoint
    holds every rank's hook state. PowerSGD: its error feedback and step count (compression starts after step 2).
    Post-local SGD with a 6-step warmup, resumed after step 4 (an averaging point): 2 more steps of global
    averaging, not 6."""
    out, ranks = runs[0], runs[1][case]
    difference = max((ranks[0]["state"][name] - value).abs().max().item()
                     for name, value in ranks[0]["straight"].items())
    print(f"{case}: resumed vs straight, max weight difference {difference:.1e}")
    assert difference <= 1e-7
    checkpoint = torch.load(out / f"{case}-epoch1.pt", weights_only=True)
    assert len(checkpoint["communication"]) == 2 and checkpoint["communication"][0]["iter"] > 0


def test_model_averaging_ranks_agree_exactly_at_averaging_points_only(runs):
    ranks = runs[1]["averaging"]
    first, second = ranks[0]["snapshots"], ranks[1]["snapshots"]
    assert len(first) == 8
    for step, (mine, theirs) in enumerate(zip(first, second), start=1):
        if step % 3 == 1:   # steps 1, 4, 7
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6, msg=f"step {step} is an averaging point")
        else:
            assert (mine - theirs).abs().max() > 1e-4, f"step {step}: ranks must differ between averaging points"
    for step, (actual, expected) in enumerate(zip(first, local_sgd_reference(period=3)), start=1):
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5, msg=f"step {step} vs plain PyTorch")
    losses = ranks[0]["history"]["loss"]
    assert losses[-1] < losses[0]


def test_model_averaging_resumes_where_it_stood(runs):
    """Epoch 1 (4 steps) saved by ModelCheckpoint, then resumed: the averager's step count comes back with the
    optimizer state, so epoch 2 averages after step 7 as a straight run does (a restarted count would average after
    steps 5 and 8). Every rank starts epoch 2 from rank 0's weights, which the checkpoint holds."""
    out, ranks = runs[0], runs[1]["averaging_resumed"]
    expected = local_sgd_reference(period=3, resumed_after=4)
    for step, (actual, wanted) in enumerate(zip(ranks[0]["snapshots"], expected[4:]), start=5):
        torch.testing.assert_close(actual, wanted, rtol=0, atol=1e-5, msg=f"step {step} vs plain PyTorch")
    checkpoint = torch.load(out / "averaging_resumed-epoch1.pt", weights_only=True)
    assert checkpoint["optimizer"]["step"] == 4, "the averager's step is saved with the optimizer"


def test_bf16_needs_nccl_and_says_so_before_training():
    with pytest.raises(ValueError, match=r"comm_hook='bf16' needs the nccl backend .* Use comm_hook='fp16'"):
        connect(DDPStrategy(comm_hook="bf16"), devices=2, accelerator="cpu")


@pytest.mark.parametrize("options, message", [
    (dict(comm_hook="int8"), "comm_hook must be one of fp16, bf16, powersgd or None; received 'int8'"),
    (dict(model_averaging_period=0), "model_averaging_period must be a positive integer; received 0"),
    (dict(powersgd_rank=0), "powersgd_rank must be a positive integer; received 0"),
    (dict(powersgd_start_step=-1), "powersgd_start_step must be an integer >= 0; received -1"),
    (dict(comm_hook="fp16", model_averaging_period=4), "cannot be combined with comm_hook"),
])
def test_bad_communication_options_are_refused_when_the_strategy_is_built(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DDPStrategy(**options)


class GradientKinds(easyfit.callbacks.Callback):
    """Whether each parameter's gradient is a view of a larger tensor (a DDP bucket), at every batch end."""

    def __init__(self):
        super().__init__()
        self.views = set()

    def on_train_batch_end(self, batch, logs=None):
        self.views |= {p.grad._base is not None for p in self.model._training.net.parameters()}


@pytest.mark.parametrize("as_views", [True, False])
def test_ddp_gradients_are_views_of_its_buckets_unless_told_otherwise(as_views):
    """Views: the device holds the gradients once, not once more in DDP's buckets; the weights are the same."""
    x, y = make_data()
    weights = []
    for options in ({}, {"gradient_as_bucket_view": as_views}):
        net, kinds = make_net(), GradientKinds()
        model = easyfit.Model(net, "cross_entropy", "sgd", lr=0.1)
        model.fit(x, y, epochs=2, batch_size=16, verbose=0, devices=1, accelerator="cpu", callbacks=[kinds],
                  strategy=DDPStrategy(**options))
        weights.append(net.state_dict())
        assert kinds.views == {options.get("gradient_as_bucket_view", True)}
    torch.testing.assert_close(weights[0], weights[1], atol=1e-7, rtol=0)
