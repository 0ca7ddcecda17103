"""Memory-sharded strategies on 2 CPU processes (gloo): they train what plain PyTorch trains on the combined batch,
they really shard, their checkpoints load into a plain net and resume exactly, and EMA and SWA average what a hand
computation averages under each of them.

Each launch runs several strategies and several checks (tests/distributed/scripts/sharded.py), and the tests of one
family of strategies share its launch: starting processes and the backends' set-up is what costs time here."""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from runner import SCRIPTS, launch_once, make_data, make_net, run_script

sys.path.insert(0, str(Path(__file__).parents[1] / "callbacks"))
from around_helpers import hand_ema, hand_swa  # the plain-PyTorch averages the callbacks' tests compare with

import easyfit
from easyfit.distributed.environments import find_free_port
from easyfit.parts.precision import cpu_supports_fp16
from easyfit.saving.convert import convert_checkpoint
from easyfit.utils.deepspeed_import import AUTOTUNER_TRACKER, autotuner_tracker_hidden

pytestmark = pytest.mark.timeout(600)

NEEDS_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="pip install easyfit[deepspeed]")
NEEDS_FAIRSCALE = pytest.mark.skipif(importlib.util.find_spec("fairscale") is None,
                                     reason="pip install easyfit[fairscale]")
TORCH_ONLY = ["zero", "fsdp", "fsdp_cpu_offload"]
DEEPSPEED = ["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload", "deepspeed_stage_3",
             "deepspeed_stage_3_offload"]
#: parameters sharded too (not only optimizer state)
PARAMETER_SHARDING = {"fsdp", "fsdp_cpu_offload", "deepspeed_stage_3", "deepspeed_stage_3_offload"}
#: the launch each family's tests share: its checks, its strategies (ddp: the memory baseline), the sharded formats
#: and those that also run the mixed-precision checks, beside ddp's (the baseline)
TORCH_LAUNCH = ("parity,memory,checkpoint,schedule,averaging", ("ddp", *TORCH_ONLY), "--sharded", "fsdp",
                "--mixed", "ddp,fsdp,zero")
DEEPSPEED_LAUNCH = ("parity,memory,checkpoint,schedule,averaging", ("ddp", *DEEPSPEED),
                    "--sharded", "deepspeed_stage_2,deepspeed_stage_3", "--mixed", "ddp,deepspeed_stage_2")


def reference(epochs: int, accumulate: int = 1, clip: float | None = None, lr: float = 0.01) -> dict:
    """Plain PyTorch, one process: Adam on the combined batch of both ranks (32 samples per micro-step)."""
    x, y = make_data()
    net = make_net()
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    window = 32 * accumulate
    for _ in range(epochs):
        for start in range(0, len(x), window):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(x[start:start + window]), y[start:start + window]).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            optimizer.step()
    return net.state_dict()


REFERENCES = {"plain": {"epochs": 6}, "accumulate_clip": {"epochs": 10, "accumulate": 2, "clip": 0.5}}


def max_difference(actual: dict, expected: dict) -> float:
    return max((actual[name] - value).abs().max().item() for name, value in expected.items())


def run(tmp_path, checks: str, strategies: list[str], *options: str, timeout: float = 500,
        env: dict | None = None) -> dict:
    process = run_script(tmp_path, checks, *strategies, *options, script="sharded.py", timeout=timeout, env=env)
    assert process.returncode == 0, process.stderr[-6000:]
    return {rank: torch.load(path, weights_only=False) for rank, path in enumerate(sorted(tmp_path.glob("[01].pt")))}


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """launch(*TORCH_LAUNCH) -> (its folder, each rank's results), run once for the module; C++ ops DeepSpeed would
    compile go to the folder's "ops"."""
    def sharded(out, checks: str, strategies: tuple, *options: str) -> dict:
        return run(out, checks, list(strategies), *options, env={"TORCH_EXTENSIONS_DIR": str(out / "ops")})
    return launch_once(tmp_path_factory, sharded)


def check_parity(outcome: dict, strategies: list[str]) -> None:
    expected = {case: reference(**options) for case, options in REFERENCES.items()}
    for strategy in strategies:
        for case, weights in outcome[0][strategy]["parity"].items():   # each case the script ran
            difference = max_difference(weights, expected[case])
            print(f"parity {strategy:28s} {case:16s} max weight difference {difference:.2e}")
            assert difference <= 1e-5, f"{strategy} ({case}) differs from plain PyTorch by {difference}"


def check_schedule(outcome: dict, strategies: list[str]) -> None:
    """LR scaling on the optimizer the strategy built: each step takes the one-process schedule (a per-step
    SequentialLR) times 2, the optimizer holds the schedule's own rate, and the fit equals plain PyTorch on the
    combined batch (accumulation 2, clipping; tests/distributed/scripts/lr_space.py)."""
    space = importlib.import_module("lr_space")
    expected = space.plain(space.SHARDED_SCHEDULE)
    for strategy in strategies:
        problems = space.differences(outcome[0][strategy]["schedule"], expected)
        assert not problems, (strategy, problems)


def check_averaging(outcome: dict, strategies: list[str]) -> None:
    """EMA and SWA on every rank: the net after the fit holds the hand-computed averages (plain PyTorch, SGD on the
    combined batch) and EMA's validation ran its averages (within 1e-6)."""
    ema, losses = hand_ema(3, 0.9)
    swa = hand_swa(epochs=3, swa_lr=0.02, start_epoch=1, annealing_epochs=1)
    for strategy in strategies:
        for rank, results in outcome.items():
            found = results[strategy]["averaging"]
            validation = zip(found["ema"]["val_loss"], losses, strict=True)
            differences = {"ema": max_difference(found["ema"]["averaged"], ema),
                           "swa": max_difference(found["swa"]["averaged"], swa),
                           "ema val_loss": max(abs(a - b) for a, b in validation)}
            assert max(differences.values()) <= 1e-6, f"{strategy} rank {rank}: {differences} from the hand averages"


def check_checkpoints(outcome: dict, strategies: list[str]) -> None:
    x, _ = make_data()
    for strategy in strategies:
        found = outcome[0][strategy]["checkpoint"]
        restored = easyfit.Model.load(found["saved"], net=make_net())   # one process, a plain net
        torch.testing.assert_close(restored.predict(x), found["predictions"], rtol=0, atol=0)
        difference = max_difference(found["resumed"], found["straight"])
        print(f"resume {strategy:28s} 4 + 4 epochs vs 8 straight: max weight difference {difference:.2e}")
        assert difference <= 1e-6, f"{strategy}: resumed training differs from straight training by {difference}"


def check_sharded_format(outcome: dict, strategies: list[str], tmp_path) -> None:
    """Sharded directories resume exactly and convert into one file that loads into a plain net on one process with
    the weights and optimizer state the fit had after epoch 4."""
    for strategy in strategies:
        found = outcome[0][strategy]["sharded"]
        difference = max_difference(found["resumed"], found["straight"])
        print(f"resume {strategy:28s} sharded directory, 4 + 4 epochs vs 8 straight: max difference {difference:.2e}")
        assert difference <= 1e-6, f"{strategy}: resumed from its sharded directory, differs by {difference}"
        converted = tmp_path / f"{strategy}-converted.pt"
        convert_checkpoint(found["directory"], converted)
        restored = easyfit.Model.load(converted, net=make_net())
        assert restored.completed_epochs == 4 and len(restored.history.history["loss"]) == 4
        torch.testing.assert_close(restored.net.state_dict(), found["epoch4"]["net"], rtol=0, atol=0)
        torch.testing.assert_close(restored.optimizer.state_dict(), found["epoch4"]["optimizer"], rtol=0, atol=0)


def check_memory(outcome: dict, strategies: list[str]) -> None:
    baseline = outcome[0]["ddp"]["memory"]
    print(f"{'strategy':28s} {'rank':>4s} {'parameters':>12s} {'ratio':>6s} {'optimizer':>12s} {'ratio':>6s}")
    for strategy in ["ddp", *strategies]:
        for rank in (0, 1):
            held = outcome[rank][strategy]["memory"]
            ratios = {key: held[key] / baseline[key] for key in held}
            print(f"{strategy:28s} {rank:4d} {held['parameters']:12d} {ratios['parameters']:6.2f} "
                  f"{held['optimizer_state']:12d} {ratios['optimizer_state']:6.2f}")
            if strategy == "ddp":
                continue
            assert ratios["optimizer_state"] <= 0.55, f"{strategy} rank {rank} holds {ratios}"
            if strategy in PARAMETER_SHARDING:
                assert ratios["parameters"] <= 0.55, f"{strategy} rank {rank} holds {ratios}"


def test_torch_sharded_strategies_match_plain_pytorch_and_shard(launch):
    _, outcome = launch(*TORCH_LAUNCH)
    check_parity(outcome, TORCH_ONLY)
    check_memory(outcome, TORCH_ONLY)
    check_schedule(outcome, TORCH_ONLY)


def test_ema_and_swa_under_the_torch_sharded_strategies_equal_the_hand_averages(launch):
    check_averaging(launch(*TORCH_LAUNCH)[1], TORCH_ONLY)


def test_torch_sharded_checkpoints_load_into_a_plain_net_and_resume_exactly(launch, tmp_path):
    """Also fsdp's sharded directory: it resumes on 2 processes, converts into one file, and resumes on 1 process."""
    out, outcome = launch(*TORCH_LAUNCH)
    check_checkpoints(outcome, TORCH_ONLY)
    check_sharded_format(outcome, ["fsdp"], tmp_path)
    one = run(out, "resume_one", ["fsdp"], "--devices", "1")[0]["fsdp"]["resume_one"]   # the launch's directory
    difference = max_difference(one["resumed"], outcome[0]["fsdp"]["sharded"]["straight"])
    print(f"resume fsdp sharded directory of 2 processes on 1 (same global batch): max difference {difference:.2e}")
    assert one["epochs"] == 8 and difference <= 1e-5


def test_the_conversion_command_writes_one_file_and_refuses_other_directories(tmp_path):
    process = subprocess.run([sys.executable, "-m", "easyfit.checkpoint_convert", str(tmp_path), str(tmp_path / "x")],
                             capture_output=True, text=True, timeout=120)
    assert process.returncode != 0 and "is not a sharded easyfit checkpoint" in process.stderr
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match=r"is a directory.*python -m easyfit.checkpoint_convert"):
        easyfit.Model.load(tmp_path, net=make_net())


@NEEDS_DEEPSPEED
def test_deepspeed_stages_match_plain_pytorch_and_shard(launch):
    """Every stage trains without compiling a C++ op, DeepSpeed's shared-memory all-reduce included (its inference
    layers' only, and 30-60 s on a machine's first fit): nothing is built in the launch's new op folder. Nor does a
    rank import mlflow, which DeepSpeed's autotuner loads with deepspeed where it is installed (1.6 CPU-s a rank)."""
    out, outcome = launch(*DEEPSPEED_LAUNCH)
    ops = out / "ops"
    check_parity(outcome, DEEPSPEED)
    check_memory(outcome, DEEPSPEED)
    check_schedule(outcome, DEEPSPEED)
    assert not ops.exists() or not any(ops.iterdir()), f"the fits compiled {sorted(ops.rglob('*.so'))}"
    assert [outcome[rank]["mlflow_imported"] for rank in (0, 1)] == [False, False]


@NEEDS_DEEPSPEED
def test_deepspeed_under_its_own_launcher_matches_plain_pytorch(tmp_path):
    """`deepspeed --num_accelerators 2 sharded.py ...` on the CPU: the strategy takes its ranks from DeepSpeed's
    launcher (the fit asks for devices=2, as many as the launcher started)."""
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_accelerators", "2", "--no_local_rank",
               "--master_port", str(find_free_port()), str(SCRIPTS / "sharded.py"), str(tmp_path), "parity",
               "deepspeed_stage_2", "--cases", "plain"]
    process = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"},
                             capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, (process.stdout + process.stderr)[-6000:]
    outcome = {rank: torch.load(tmp_path / f"{rank}.pt", weights_only=False) for rank in (0, 1)}
    check_parity(outcome, ["deepspeed_stage_2"])
    torch.testing.assert_close(outcome[1]["deepspeed_stage_2"]["parity"], outcome[0]["deepspeed_stage_2"]["parity"],
                               rtol=0, atol=0)


@NEEDS_DEEPSPEED
def test_ema_and_swa_under_every_deepspeed_stage_equal_the_hand_averages(launch):
    check_averaging(launch(*DEEPSPEED_LAUNCH)[1], DEEPSPEED)


@NEEDS_DEEPSPEED
def test_deepspeed_checkpoints_load_into_a_plain_net_and_resume_exactly(launch, tmp_path):
    """Also DeepSpeed's own directory (stages 2 and 3): it resumes and converts into one plain file."""
    _, outcome = launch(*DEEPSPEED_LAUNCH)
    check_checkpoints(outcome, DEEPSPEED)
    check_sharded_format(outcome, ["deepspeed_stage_2", "deepspeed_stage_3"], tmp_path)


def check_mixed_precision(outcome: dict, strategies: list[str]) -> None:
    """bf16-mixed: the loss falls, each epoch's loss is within 5e-3 of DDP's under bf16-mixed and the fp32 weights
    within 1e-2 (bf16 rounding differs: FSDP2 casts parameters per layer, DeepSpeed keeps a bf16 copy of the net).
    16-mixed: a gradient that overflows in one rank's shard only makes every rank skip the step, as under DDP (a
    rank that stepped alone would leave the shards of one net out of step, silently). On a CPU without float16
    kernels DeepSpeed cannot run 16-mixed: every rank refuses it before any work, naming what to use instead."""
    baseline = outcome[0]["ddp"]["bf16"]
    for strategy in strategies:
        found = outcome[0][strategy]["bf16"]
        losses = [abs(a - b) for a, b in zip(found["loss"], baseline["loss"], strict=True)]
        difference = max_difference(found["weights"], baseline["weights"])
        print(f"bf16-mixed {strategy:20s} loss {found['loss'][0]:.4f} -> {found['loss'][-1]:.4f}; vs ddp: loss "
              f"{max(losses):.1e}, weights {difference:.1e}")
        assert found["loss"][-1] < 0.6 * found["loss"][0], f"{strategy} does not train under bf16-mixed"
        assert max(losses) <= 5e-3 and difference <= 1e-2, f"{strategy} departs from DDP under bf16-mixed"
    for rank in (0, 1):
        for strategy in ("ddp", *strategies):
            found = outcome[rank][strategy]["overflow"]
            if "refused" in found:
                assert not cpu_supports_fp16() and "use precision='bf16-mixed'" in found["refused"].lower()
                continue
            # DeepSpeed's fp32 master weights start from its fp16 copy of the net: up to 1e-4 of rounding
            assert max(outcome[rank][strategy]["overflow"]["row_change"]) <= 1e-3, \
                f"16-mixed under {strategy}: rank {rank} stepped on an overflow another rank saw"


def test_mixed_precision_under_fsdp_and_zero_trains_like_ddp(launch):
    check_mixed_precision(launch(*TORCH_LAUNCH)[1], ["fsdp", "zero"])


@NEEDS_DEEPSPEED
def test_mixed_precision_under_deepspeed_trains_like_ddp(launch):
    check_mixed_precision(launch(*DEEPSPEED_LAUNCH)[1], ["deepspeed_stage_2"])


@NEEDS_FAIRSCALE
def test_fairscale_sharded_matches_plain_pytorch_shards_and_resumes(tmp_path):
    outcome = run(tmp_path, "parity,memory,checkpoint,schedule,averaging", ["ddp", "ddp_sharded"])
    check_averaging(outcome, ["ddp_sharded"])   # FairScale's optimizer moves the weights' storage at its first step
    check_parity(outcome, ["ddp_sharded"])
    check_schedule(outcome, ["ddp_sharded"])
    check_memory(outcome, ["ddp_sharded"])
    check_checkpoints(outcome, ["ddp_sharded"])


@NEEDS_FAIRSCALE
def test_fairscale_sharded_spawn_trains_like_plain_pytorch(tmp_path):
    """The same strategy as ddp_sharded with spawned ranks: the caller's net gets rank 0's weights."""
    check_parity(run(tmp_path, "parity", ["ddp_sharded_spawn"], "--cases", "plain"), ["ddp_sharded_spawn"])


# ---------------------------------------------------------------- in this process
def test_a_missing_optional_package_names_the_extra_to_install(monkeypatch):
    from easyfit.distributed.strategy_parts.sharding import require
    monkeypatch.setitem(__import__("sys").modules, "fairscale", None)
    with pytest.raises(ImportError, match=r"strategy 'ddp_sharded' needs the fairscale package.*"
                                          r"pip install easyfit\[fairscale\]"):
        require("fairscale.optim.oss", "fairscale", "ddp_sharded")


def test_deepspeed_s_first_import_takes_mlflow_for_absent_and_leaves_it_importable(monkeypatch):
    """DeepSpeed's autotuner imports mlflow with deepspeed, where it is installed, for tuning runs a fit never starts:
    around deepspeed's first import mlflow reads as absent, and imports as usual after; a tracker the user imported
    before is left alone."""
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    monkeypatch.delitem(sys.modules, AUTOTUNER_TRACKER, raising=False)
    with autotuner_tracker_hidden():
        with pytest.raises(ImportError):
            importlib.import_module(AUTOTUNER_TRACKER)
    assert AUTOTUNER_TRACKER not in sys.modules
    users = types.ModuleType(AUTOTUNER_TRACKER)
    monkeypatch.setitem(sys.modules, AUTOTUNER_TRACKER, users)
    with autotuner_tracker_hidden():
        assert importlib.import_module(AUTOTUNER_TRACKER) is users


def test_the_rebuilt_optimizer_keeps_class_hyper_parameters_and_groups():
    from easyfit.distributed.strategy_parts.sharding import rebuild_optimizer
    net = make_net()
    optimizer = torch.optim.AdamW([{"params": net[0].parameters(), "lr": 0.5, "weight_decay": 0.1},
                                   {"params": net[2].parameters()}], lr=0.01, betas=(0.8, 0.9))
    copies = {id(p): torch.nn.Parameter(p.detach().clone()) for p in net.parameters()}
    rebuilt = rebuild_optimizer(optimizer, lambda p: copies[id(p)])
    assert type(rebuilt) is torch.optim.AdamW and rebuilt.defaults == optimizer.defaults
    for group, original in zip(rebuilt.param_groups, optimizer.param_groups):
        assert {k: v for k, v in group.items() if k != "params"} == {k: v for k, v in original.items() if k != "params"}
        assert all(p is copies[id(q)] for p, q in zip(group["params"], original["params"], strict=True))


def test_deepspeed_config_derives_from_fit_and_the_user_keys_win(tmp_path, monkeypatch):
    from easyfit.distributed.strategies.deepspeed import DeepSpeedStrategy
    from easyfit.training.loop import TrainingSettings
    path = tmp_path / "ds.json"
    path.write_text('{"gradient_clipping": 2.0, "zero_optimization": {"reduce_bucket_size": 1000}}')
    monkeypatch.setenv("EASYFIT_DEEPSPEED_CONFIG", str(path))
    strategy = easyfit.strategies.DeepSpeed(stage=3, offload_optimizer=True, offload_parameters=True,
                                            allgather_bucket_size=5e8, reduce_bucket_size=5e8)
    assert isinstance(strategy, DeepSpeedStrategy)
    config = strategy.config(TrainingSettings(batch_size=16, gradient_accumulation_steps=4, precision="bf16-mixed"))
    assert config["train_micro_batch_size_per_gpu"] == 16 and config["gradient_accumulation_steps"] == 4
    assert config["gradient_clipping"] == 2.0 and config["bf16"] == {"enabled": True}
    assert config["zero_optimization"]["reduce_bucket_size"] == 1000   # the user's key won
    assert config["zero_optimization"]["allgather_bucket_size"] == 500_000_000
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert config["zero_force_ds_cpu_optimizer"] is False
    monkeypatch.delenv("EASYFIT_DEEPSPEED_CONFIG")
    plain = easyfit.strategies.DeepSpeed()
    assert plain.config(TrainingSettings())["gradient_clipping"] == 0.0, \
        "DeepSpeed's default of 1.0 must not apply silently"


def test_deepspeed_buckets_are_sized_from_the_net_unless_the_user_sets_them(monkeypatch):
    """DeepSpeed's 5e8-element buckets held 4x plain PyTorch's GPU memory on a 33.6 M-parameter net."""
    from easyfit.distributed.strategy_parts.deepspeed_config import DeepSpeedConfig, bucket_elements
    from easyfit.training.loop import TrainingSettings
    monkeypatch.delenv("EASYFIT_DEEPSPEED_CONFIG", raising=False)
    assert bucket_elements(33_600_000) == 1_050_624 and bucket_elements(20_000) == 20_480
    assert bucket_elements(10 ** 11) == 499_999_744 and bucket_elements(12_345) % 1024 == 0   # DeepSpeed's alignment
    stage3 = easyfit.strategies.DeepSpeed(stage=3)
    zero = stage3.config(TrainingSettings(), num_params=33_600_000)["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 1_050_624
    assert zero["stage3_prefetch_bucket_size"] == 1_050_624
    assert DeepSpeedConfig.describe(stage3.config(TrainingSettings(), 33_600_000)) == \
        "DeepSpeed buckets (elements): reduce_bucket 1.05e+06, allgather_bucket 1.05e+06, prefetch_bucket 1.05e+06"
    given = easyfit.strategies.DeepSpeed(reduce_bucket_size=4e6, config={"zero_optimization": {"overlap_comm": False}})
    zero = given.config(TrainingSettings(), num_params=33_600_000)["zero_optimization"]
    assert zero["reduce_bucket_size"] == 4_000_000 and zero["allgather_bucket_size"] == 1_050_624
    assert zero["overlap_comm"] is False and "stage3_prefetch_bucket_size" not in zero


def test_a_sharded_directory_outside_a_sharded_fit_says_how_to_resume_or_convert_it(tmp_path):
    from easyfit.strategies import FSDP, DeepSpeed, Fit
    for strategy, words in ((FSDP(), "under strategy='fsdp'"), (DeepSpeed(stage=3), "on as many processes")):
        with pytest.raises(ValueError, match=rf"is a .* checkpoint directory: resume it with fit\(resume_from=...\) "
                                             rf".*{words}.*python -m easyfit.checkpoint_convert"):
            strategy.load_checkpoint(Fit(strategy=strategy, net=torch.nn.Linear(2, 2)), str(tmp_path))


@NEEDS_DEEPSPEED
def test_deepspeed_16_mixed_on_a_cpu_without_float16_is_refused_before_any_rank_starts(monkeypatch):
    from easyfit.distributed.launchers.script import ScriptLauncher
    from easyfit.distributed.strategies import deepspeed
    monkeypatch.setattr(deepspeed, "cpu_supports_fp16", lambda: False)
    monkeypatch.setattr(ScriptLauncher, "start", lambda *args, **kwargs: pytest.fail("ranks were started"))
    x, y = make_data()
    model = easyfit.Model(make_net(), "cross_entropy", "sgd")
    with pytest.raises(ValueError, match=r"no float16 kernels.*precision='bf16-mixed'.*strategy='fsdp'"):
        model.fit(x, y, devices=2, accelerator="cpu", strategy="deepspeed", precision="16-mixed", verbose=0)
