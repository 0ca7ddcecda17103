"""The connector's table: which strategy each call gets, how it is configured, and every conflict's words.

Pure dispatch logic: CUDA, the launcher variables and "is this a notebook" are faked; no process is started.
"""
from __future__ import annotations

import os
import re

import pytest
import torch

import easyfit
from easyfit.distributed import calls
from easyfit.distributed.connector import connect
from easyfit.distributed.launchers import ProcessLauncher
from easyfit.distributed.strategies.ddp import DDPStrategy
from easyfit.distributed.strategies.ddp2 import DDP2Strategy
from easyfit.distributed.strategies.dp import DataParallelStrategy
from easyfit.distributed.strategies.registry import strategy_names
from easyfit.distributed.strategies.single import SingleDeviceStrategy

LAUNCHER_VARIABLE = re.compile(r"(SLURM|OMPI|PMI|MPI_LOCAL|HOROVOD|TORCHELASTIC|EASYFIT)_|(MASTER_ADDR|MASTER_PORT|"
                               r"WORLD_SIZE|RANK|LOCAL_RANK|NODE_RANK|GROUP_RANK|LOCAL_WORLD_SIZE|CROSS_RANK|"
                               r"CROSS_SIZE|LOCAL_SIZE)$")
TWO_NODES_BY_HAND = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "0"}
TORCHRUN = {"TORCHELASTIC_RUN_ID": "run", "WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1",
            "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29400"}
TORCHRUN_ONE_NODE = {**TORCHRUN, "WORLD_SIZE": "2", "RANK": "1", "GROUP_RANK": "0"}
SLURM = {"SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NAME": "train"}
OPEN_MPI = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
CPU2 = {"devices": 2, "accelerator": "cpu"}


@pytest.fixture(autouse=True)
def plain_script(monkeypatch):
    """A plain `python script.py` on a machine without GPUs, whatever runs the tests."""
    for name in [name for name in os.environ if LAUNCHER_VARIABLE.match(name)]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(calls, "is_interactive", lambda: False)


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has 4 CUDA GPUs (nothing here touches them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


@pytest.fixture
def notebook(monkeypatch):
    monkeypatch.setattr(calls, "is_interactive", lambda: True)


@pytest.fixture
def env(monkeypatch):
    def set_variables(variables: dict[str, str]) -> None:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
    return set_variables


def kind(strategy) -> tuple[str, str | None]:
    """(class name, start method) of a connected strategy."""
    return type(strategy).__name__, getattr(strategy, "start_method", None)


# ---------------------------------------------------------------- strategy="auto"
# (call arguments, launcher variables, in a notebook, fake GPUs) -> (class, start method, world size)
AUTO = {
    "one cpu process": (dict(devices=1, accelerator="cpu"), {}, False, False, ("SingleDeviceStrategy", None, 1)),
    "devices auto on cpu": (dict(accelerator="cpu"), {}, False, False, ("SingleDeviceStrategy", None, 1)),
    "one gpu": (dict(devices=1), {}, False, True, ("SingleDeviceStrategy", None, 1)),
    "several cpu processes in a script": (CPU2, {}, False, False, ("DDPStrategy", "popen", 2)),
    "every gpu in a script": (dict(devices=-1), {}, False, True, ("DDPStrategy", "popen", 4)),
    "several processes in a notebook": (CPU2, {}, True, False, ("DDPStrategy", "fork", 2)),
    "several nodes": (dict(devices=1, accelerator="cpu", num_nodes=2), TWO_NODES_BY_HAND, False, False,
                      ("DDPStrategy", "popen", 2)),
    "several nodes from a notebook": (dict(devices=1, accelerator="cpu", num_nodes=2), TWO_NODES_BY_HAND, True,
                                      False, ("DDPStrategy", "popen", 2)),
    "torchrun with 2 processes": (dict(accelerator="cpu"), TORCHRUN_ONE_NODE, False, False,
                                  ("DDPStrategy", "popen", 2)),
    "torchrun beats the notebook guess": (dict(accelerator="cpu"), TORCHRUN_ONE_NODE, True, False,
                                          ("DDPStrategy", "popen", 2)),
    "torchrun with 1 process": (dict(accelerator="cpu"), {**TORCHRUN_ONE_NODE, "WORLD_SIZE": "1", "RANK": "0",
                                                           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"},
                                False, False, ("SingleDeviceStrategy", None, 1)),
    "mpirun with 2 processes": (dict(accelerator="cpu"), OPEN_MPI, False, False, ("DDPStrategy", "popen", 2)),
    "slurm with 4 tasks on 2 nodes": (dict(accelerator="cpu", num_nodes=2), SLURM, False, False,
                                      ("DDPStrategy", "popen", 4)),
}


@pytest.mark.parametrize("case", AUTO.values(), ids=AUTO.keys())
def test_auto_picks_by_devices_nodes_session_and_launcher(case, env, request):
    arguments, variables, interactive, fake_gpus, (cls, start_method, world_size) = case
    env(variables)
    if interactive:
        request.getfixturevalue("notebook")
    if fake_gpus:
        request.getfixturevalue("gpus")
    strategy = connect(**arguments)
    assert kind(strategy) == (cls, start_method)
    assert strategy.world_size == world_size


def test_auto_on_one_gpu_uses_that_gpu(gpus):
    strategy = connect(devices=[2])
    assert isinstance(strategy, SingleDeviceStrategy) and strategy.root_device == torch.device("cuda", 2)


# ---------------------------------------------------------------- explicit names
# name -> (class, start method, launcher)
NAMED = {
    "single": ("SingleDeviceStrategy", None, None),
    "ddp": ("DDPStrategy", "popen", "ScriptLauncher"),
    "ddp_spawn": ("DDPStrategy", "spawn", "ProcessLauncher"),
    "ddp_fork": ("DDPStrategy", "fork", "ProcessLauncher"),
    "ddp_notebook": ("DDPStrategy", "fork", "ProcessLauncher"),
    "dp": ("DataParallelStrategy", None, None),
    "ddp2": ("DDP2Strategy", None, None),
    "zero": ("ZeroStrategy", "popen", "ScriptLauncher"),
    "fsdp": ("FSDPStrategy", "popen", "ScriptLauncher"),
    "fsdp_cpu_offload": ("FSDPStrategy", "popen", "ScriptLauncher"),
    "tp": ("ModelParallelStrategy", "popen", "ScriptLauncher"),
    "fsdp_tp": ("ModelParallelStrategy", "popen", "ScriptLauncher"),
    "ddp_sharded": ("ShardedStrategy", "popen", "ScriptLauncher"),
    "ddp_sharded_spawn": ("ShardedStrategy", "spawn", "ProcessLauncher"),
    **{name: ("DeepSpeedStrategy", "popen", "ScriptLauncher") for name in
       ("deepspeed", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload", "deepspeed_stage_3",
        "deepspeed_stage_3_offload")},
    "horovod": ("HorovodStrategy", None, "HorovodLauncher"),
    "bagua": ("BaguaStrategy", None, "ScriptLauncher"),
    "pipeline": ("PipelineStrategy", None, "ScriptLauncher"),
    "xla": ("XLAStrategy", None, None),
}


def test_the_table_names_every_strategy_tested_here():
    assert set(strategy_names()) == set(NAMED)


@pytest.mark.parametrize("name", NAMED)
def test_each_name_gives_its_class_start_method_and_launcher(name, gpus, env):
    if name == "bagua":
        pytest.importorskip("bagua.torch_api", reason="Bagua is not installed (tests/distributed/test_bagua.py)")
    if name == "xla":
        pytest.importorskip("torch_xla", reason="torch_xla is not installed (tests/xla, scripts/install_xla.sh)")
    env(TWO_NODES_BY_HAND)
    arguments = {"single": dict(devices=1), "ddp2": dict(devices=2, num_nodes=2),
                 "xla": dict(devices=1)}.get(name, dict(devices=2))
    strategy = connect(name.upper() if name == "ddp" else name, **arguments)   # names are case-insensitive
    launcher = strategy.make_launcher()
    assert (*kind(strategy), type(launcher).__name__ if launcher else None) == NAMED[name]
    if isinstance(launcher, ProcessLauncher):
        assert launcher.start_method == strategy.start_method


def test_ddp_on_gpus_is_configured_for_nccl_one_gpu_per_process(gpus):
    strategy = connect("ddp", devices="1, 3")
    assert strategy.parallel_devices == [torch.device("cuda", 1), torch.device("cuda", 3)]
    assert strategy.process_group_backend == "nccl" and strategy.accelerator == "cuda"
    strategy.configure_rank(1)
    assert (strategy.global_rank, strategy.root_device) == (1, torch.device("cuda", 3))


def test_ddp_on_cpu_uses_gloo_unless_told():
    assert connect("ddp_spawn", **CPU2).process_group_backend == "gloo"
    assert connect("ddp_spawn", **CPU2, process_group_backend="mpi").process_group_backend == "mpi"


# ---------------------------------------------------------------- batch_factor
def test_batch_factor_of_process_strategies_is_the_world_size(env):
    env(TWO_NODES_BY_HAND)
    for name in ("ddp", "ddp_spawn", "ddp_fork", "ddp_notebook"):
        assert connect(name, **CPU2).batch_factor == 2
    assert connect("ddp", **CPU2, num_nodes=2).batch_factor == 4


def test_batch_factor_of_dp_is_one(gpus):
    strategy = connect("dp", devices=4)
    assert isinstance(strategy, DataParallelStrategy)
    assert (strategy.batch_factor, strategy.world_size, len(strategy.parallel_devices)) == (1, 1, 4)


def test_batch_factor_of_ddp2_is_the_number_of_nodes(gpus, env):
    env(TWO_NODES_BY_HAND)
    strategy = connect("ddp2", devices=4, num_nodes=2)
    assert isinstance(strategy, DDP2Strategy)
    assert (strategy.batch_factor, strategy.world_size, strategy.num_processes) == (2, 2, 1)
    assert len(strategy.node_devices) == 4


def test_ddp2_under_slurm_runs_one_task_per_node(gpus, env):
    env({**SLURM, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"})
    strategy = connect("ddp2", devices=4, num_nodes=2)
    assert (strategy.batch_factor, strategy.global_rank, strategy.node_rank) == (2, 1, 1)


# ---------------------------------------------------------------- precedence
def test_a_strategy_object_is_used_as_given_and_its_unset_fields_filled_in_a_copy(notebook):
    given = DDPStrategy(start_method="spawn", find_unused_parameters=True)
    strategy = connect(given, **CPU2)
    assert strategy is not given and given.parallel_devices is None   # the user's object is left as made
    assert kind(strategy) == ("DDPStrategy", "spawn")   # not the notebook's fork
    assert strategy.parallel_devices == [torch.device("cpu")] * 2 and strategy.num_nodes == 1
    assert strategy.process_group_backend == "gloo" and strategy.environment.name == "local"
    assert strategy.wrapping.find_unused_parameters


def test_a_strategy_object_keeps_what_it_was_given(gpus):
    given = DDPStrategy(process_group_backend="gloo", parallel_devices=[torch.device("cuda", 3)] * 2)
    strategy = connect(given, devices=2)
    assert strategy.process_group_backend == "gloo"
    assert strategy.parallel_devices == [torch.device("cuda", 3)] * 2


def test_torchrun_says_the_ranks_and_auto_devices_adopt_its_processes_per_node(env, notebook):
    env(TORCHRUN)
    strategy = connect(accelerator="cpu", num_nodes=2)
    assert kind(strategy) == ("DDPStrategy", "popen") and strategy.make_launcher() is None   # already launched
    assert (strategy.world_size, strategy.global_rank, strategy.local_rank, strategy.node_rank) == (4, 3, 1, 1)
    assert strategy.num_processes == 2 and strategy.environment.name == "torchrun"


def test_slurm_says_the_ranks(env):
    env(SLURM)
    strategy = connect("ddp", accelerator="cpu", num_nodes=2)
    assert (strategy.world_size, strategy.global_rank, strategy.local_rank, strategy.node_rank) == (4, 3, 1, 1)
    assert strategy.make_launcher() is None and strategy.environment.name == "SLURM"


def test_auto_gpus_under_a_launcher_are_one_per_local_process(env, gpus):
    env(TORCHRUN)
    strategy = connect(num_nodes=2)
    assert strategy.parallel_devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert strategy.root_device == torch.device("cuda", 1)   # LOCAL_RANK=1


# ---------------------------------------------------------------- conflicts, with their words
def test_unknown_name_suggests_the_closest_and_lists_the_valid_ones():
    with pytest.raises(ValueError) as error:
        connect("dpp", devices="garbage")   # the name is reported before the devices
    message = str(error.value)
    assert message.startswith("unknown strategy 'dpp'.") and "'ddp'" in message
    assert f"Valid names: auto, {', '.join(strategy_names())}." in message


def test_single_on_two_devices():
    with pytest.raises(ValueError, match=r"strategy='single' runs one process on one device, but this call asks "
                                         r"for 2 device\(s\) × 1 node\(s\).*Use strategy='ddp' or 'auto'"):
        connect("single", **CPU2)


def test_single_on_two_nodes_says_so_before_asking_for_node_variables():
    with pytest.raises(ValueError, match=r"strategy='single'.* 1 device\(s\) × 2 node\(s\).*num_nodes=1"):
        connect("single", devices=1, accelerator="cpu", num_nodes=2)


def test_single_under_a_launcher_runs_this_process_alone(env):
    env(TORCHRUN_ONE_NODE)   # e.g. a rank-local evaluation between multi-process calls
    strategy = connect("single", accelerator="cpu")
    assert isinstance(strategy, SingleDeviceStrategy) and strategy.world_size == 1


@pytest.mark.parametrize("devices", [2, "auto"])
def test_dp_without_cuda_names_ddp(devices):
    with pytest.raises(RuntimeError, match="strategy='dp' splits each batch across CUDA GPUs, and torch sees none "
                                           "here. On CPU use strategy='ddp' with devices=N"):
        connect("dp", devices=devices, accelerator="cpu")


def test_dp_on_several_nodes(gpus):
    with pytest.raises(ValueError, match="strategy='dp' runs in one process on one node; for several nodes use "
                                         "'ddp', or 'ddp2'"):
        connect("dp", devices=2, num_nodes=2)


@pytest.mark.parametrize("name", ["ddp_spawn", "ddp_fork", "ddp_notebook"])
def test_starting_processes_under_torchrun(name, env):
    env(TORCHRUN_ONE_NODE)
    with pytest.raises(ValueError, match=f"strategy='{name}' starts its own processes, but this one was already "
                                         "started by torchrun as one of several ranks. Use strategy='ddp'"):
        connect(name, accelerator="cpu")


@pytest.mark.parametrize("name", ["ddp_spawn", "ddp_fork", "ddp_notebook"])
def test_local_launchers_on_several_nodes(name, env):
    for variables in ({}, TWO_NODES_BY_HAND):   # the strategy's conflict is named first, variables set or not
        env(variables)
        with pytest.raises(ValueError, match=f"strategy='{name}' starts processes on this machine only; for "
                                             "num_nodes > 1 .* with strategy='ddp'"):
            connect(name, **CPU2, num_nodes=2)


def test_ddp_in_a_notebook_suggests_ddp_notebook(notebook):
    with pytest.raises(ValueError, match="strategy='ddp' re-runs your script .* this is a notebook or REPL. Use "
                                         "strategy='ddp_notebook'"):
        connect("ddp", **CPU2)
    assert kind(connect("ddp_notebook", **CPU2)) == ("DDPStrategy", "fork")
    assert kind(connect("ddp", devices=1, accelerator="cpu")) == ("DDPStrategy", "popen")   # one process: no re-run


def test_slurm_tasks_must_be_nodes_times_devices(env):
    env({**SLURM, "SLURM_NNODES": "1"})
    with pytest.raises(ValueError) as error:
        connect("ddp", **CPU2)
    assert str(error.value) == (
        "SLURM started 4 tasks (4 per node) but fit asks for num_nodes=1 × devices=2 = 2 processes; "
        "set #SBATCH --nodes=1 and #SBATCH --ntasks-per-node=2, or pass devices=4 to fit.")


def test_torchrun_processes_per_node_must_match_devices(env):
    env(TORCHRUN)
    with pytest.raises(ValueError, match=r"torchrun started 4 processes \(2 per node\) but fit asks for "
                                         r"num_nodes=2 × devices=3 = 6 processes; run torchrun --nnodes=2 "
                                         r"--nproc-per-node=3 on each node, or pass devices=2 to fit"):
        connect("ddp", devices=3, accelerator="cpu", num_nodes=2)


@pytest.mark.parametrize("num_nodes", [0, -1, 1.5, True, "2"])
def test_num_nodes_must_be_a_positive_integer(num_nodes):
    with pytest.raises(ValueError, match=f"num_nodes must be a positive integer, got {re.escape(repr(num_nodes))}"):
        connect("ddp", **CPU2, num_nodes=num_nodes)


def test_a_strategy_object_prints_before_the_connector_configures_it():
    from easyfit.strategies import DDP
    assert repr(DDP()) == ("DDPStrategy(accelerator=None, processes_per_node=None, num_nodes=None, "
                                             "backend=None)")


def test_a_registered_strategy_is_taken_by_name_and_its_names_cannot_clash(monkeypatch):
    """One table serves fit(strategy=...) and easyfit.strategies: a user's class joins it as the built-in ones do."""
    import easyfit.strategies
    from easyfit.distributed.strategies import registry
    monkeypatch.setattr(registry, "_registered", list(registry.BUILT_IN))

    class MySingle(SingleDeviceStrategy):
        name = "my_single"

    easyfit.strategies.register(MySingle)
    assert type(connect("my_single", devices=1, accelerator="cpu")) is MySingle
    assert easyfit.strategies.MySingle is MySingle and "my_single" in strategy_names()
    with pytest.raises(ValueError, match="my_single are taken already"):
        easyfit.strategies.register(MySingle)
    with pytest.raises(ValueError, match="ddp are taken already"):
        easyfit.strategies.register(MySingle, names={"ddp": {}}, public_name="Other")


def test_a_call_makes_its_launcher_once_in_its_plan_and_the_strategy_keeps_none(monkeypatch):
    import pickle

    from easyfit.distributed.launchers import ScriptLauncher
    from easyfit.distributed.run_options import RunOptions
    from easyfit.training.fit_options import FitOptions
    from easyfit.training.on_rank import FIT
    from easyfit.training.plan import plan_call
    made, make = [], DDPStrategy.make_launcher
    monkeypatch.setattr(DDPStrategy, "make_launcher", lambda self: made.append(make(self)) or made[-1])
    plan = plan_call(easyfit.Model(torch.nn.Linear(2, 2)), FIT,
                     RunOptions(strategy=DDPStrategy(), devices=2, accelerator="cpu"), FitOptions(verbose=0))
    assert len(made) == 1 and isinstance(made[0], ScriptLauncher) and plan.launcher is made[0]
    assert not any(isinstance(value, ScriptLauncher) for value in vars(plan.strategy).values())
    copy = pickle.loads(pickle.dumps(plan.strategy))
    assert isinstance(make(copy), ScriptLauncher)


def test_a_strategy_with_its_own_optimizer_step_is_not_compiled_past_it():
    from easyfit.distributed.strategies.base import Strategy

    class OwnStep(Strategy):
        def optimizer_step(self, fit, precision):
            precision.optimizer_step(fit.optimizer)

    class SaysPlain(OwnStep):
        plain_optimizer_step = True

    assert Strategy.plain_optimizer_step and not OwnStep.plain_optimizer_step and SaysPlain.plain_optimizer_step
    assert connect("ddp", devices=2, accelerator="cpu").plain_optimizer_step


@pytest.mark.parametrize("public_name", ["DDP", "FSDP", "Zero"])
def test_one_strategy_object_serves_two_calls_with_different_devices(public_name):
    """configure fills a copy: the user's object stays as they made it, and a second call gets its own devices."""
    strategy = getattr(easyfit.strategies, public_name)(start_method="spawn")
    made = dict(vars(strategy))
    first = connect(strategy, devices=2, accelerator="cpu")
    second = connect(strategy, devices=3, accelerator="cpu")
    assert (first.num_processes, second.num_processes) == (2, 3)
    assert vars(strategy).keys() == made.keys() and all(vars(strategy)[key] is made[key] for key in made)
