"""Launch environments read from their variables: detection, ranks, addresses, ports, validation, precedence."""
from __future__ import annotations

import os
import random
import socket

import pytest
import torch

import easyfit
from easyfit.distributed import environments
from easyfit.distributed.connector import connect
from easyfit.distributed.environments import (
    FIRST_CHOSEN_PORT,
    LAUNCHED_RANK_VARIABLE,
    DeepSpeedEnvironment,
    LocalEnvironment,
    MPIEnvironment,
    RayEnvironment,
    TorchElasticEnvironment,
    detect_environment,
    find_free_port,
    outgoing_ports_start,
)
from easyfit.distributed.environments.slurm import SLURMEnvironment, expand_nodelist
from easyfit.distributed.launchers import RelaunchedRankLauncher
from easyfit.distributed.run_options import RunOptions
from easyfit.training.on_rank import EVALUATE, PREDICT
from easyfit.training.plan import LoopOptions, plan_call
from easyfit.tuning.batch_size_finder import FIND_BATCH_SIZE

PREFIXES = ("SLURM_", "OMPI_", "PMI_", "MPI_LOCAL", "HOROVOD_", "TORCHELASTIC_", "EASYFIT_", "RAY_")
NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
         "LOCAL_WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")

TORCHRUN = {"TORCHELASTIC_RUN_ID": "job7", "WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1", "GROUP_RANK": "2",
            "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29400"}
DEEPSPEED = {"WORLD_SIZE": "8", "RANK": "6", "LOCAL_RANK": "2", "CROSS_RANK": "1", "CROSS_SIZE": "2",
             "LOCAL_SIZE": "4", "MASTER_ADDR": "10.0.0.3", "MASTER_PORT": "29500"}
SLURM = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
         "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "node[001-003,007],gpu5", "SLURM_JOB_NAME": "train"}
OPEN_MPI = {"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
HOROVOD_GLOO = {"HOROVOD_SIZE": "8", "HOROVOD_RANK": "5", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "4",
                "HOROVOD_CROSS_RANK": "1", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.5"}
MPICH = {"PMI_SIZE": "8", "PMI_RANK": "5", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
#: a Ray Train worker of a 2-node, 4-worker run: Ray's torch backend's variables, and any Ray worker's RAY_RAYLET_PID
RAY_WORKER = {"RAY_RAYLET_PID": "4242", "WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "NODE_RANK": "1",
              "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "52761"}
CHILD = {LAUNCHED_RANK_VARIABLE: "1", "WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "NODE_RANK": "1",
         "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    """No launcher variable from the machine running the tests leaks in."""
    for name in list(os.environ):
        if name.startswith(PREFIXES) or name in NAMES:
            monkeypatch.delenv(name)


@pytest.fixture
def env(monkeypatch):
    def set_variables(*tables: dict[str, str], **more: str) -> None:
        for table in (*tables, more):
            for name, value in table.items():
                monkeypatch.setenv(name, value)
    return set_variables


def identity(environment) -> tuple[int, int, int, int]:
    return (environment.world_size(), environment.global_rank(), environment.local_rank(),
            environment.node_rank())


# ---------------------------------------------------------------- what each launcher's variables say
# variables, environment, (world, global rank, local rank, node rank), processes per node, main address,
# main port, a (num_nodes, devices) that agrees
READINGS = {
    "easyfit-child": (CHILD, LocalEnvironment, (4, 3, 1, 1), 2, "10.0.0.1", 1234, (2, 2)),
    "torchrun": (TORCHRUN, TorchElasticEnvironment, (8, 5, 1, 2), 2, "10.0.0.9", 29400, (4, 2)),
    "torchrun-no-run-id": ({name: value for name, value in TORCHRUN.items() if name != "TORCHELASTIC_RUN_ID"},
                           TorchElasticEnvironment, (8, 5, 1, 2), 2, "10.0.0.9", 29400, (4, 2)),
    "deepspeed": (DEEPSPEED, DeepSpeedEnvironment, (8, 6, 2, 1), 4, "10.0.0.3", 29500, (2, 4)),
    "open-mpi": ({**OPEN_MPI, "MASTER_ADDR": "10.0.0.4"}, MPIEnvironment, (8, 5, 1, 1), 4, "10.0.0.4", 29500, (2, 4)),
    "horovodrun-gloo": (HOROVOD_GLOO, MPIEnvironment, (8, 5, 1, 1), 4, "10.0.0.5", 29500, (2, 4)),
    "mpich": ({**MPICH, "MASTER_ADDR": "10.0.0.4"}, MPIEnvironment, (8, 5, 1, 1), 4, "10.0.0.4", 29500, (2, 4)),
    "mpich-one-node": ({**MPICH, "MPI_LOCALRANKID": "5", "MPI_LOCALNRANKS": "8", "MASTER_PORT": "3000"},
                       MPIEnvironment, (8, 5, 5, 0), 8, "127.0.0.1", 3000, (1, 8)),
    "slurm": (SLURM, SLURMEnvironment, (8, 5, 1, 1), 4, "node001", 10000 + 123456 % 20000, (2, 4)),
}


@pytest.mark.parametrize("case", READINGS.values(), ids=READINGS.keys())
def test_each_launcher_is_detected_and_read(env, case):
    variables, kind, ranks, per_node, address, port, (num_nodes, devices) = case
    env(variables)
    environment = detect_environment()
    assert type(environment) is kind and environment.creates_processes_externally
    assert identity(environment) == ranks and environment.local_world_size() == per_node
    assert (environment.main_address, environment.main_port) == (address, port)
    environment.validate(num_nodes=num_nodes, devices_per_node=devices)


# ---------------------------------------------------------------- plain local run
def test_plain_run_is_local_and_launches_the_others():
    environment = detect_environment()
    assert type(environment) is LocalEnvironment and not environment.creates_processes_externally
    assert environment.name == "local"
    assert identity(environment) == (1, 0, 0, 0) and environment.local_world_size() is None
    assert environment.main_address == "127.0.0.1"
    port = environment.main_port
    assert 0 < port < 65536 and environment.main_port == port  # found once, then cached


def test_plain_run_takes_the_world_its_strategy_sets():
    environment = LocalEnvironment()
    environment.set_world(4, 2, 2)
    assert identity(environment) == (4, 2, 2, 0)
    environment.validate(num_nodes=1, devices_per_node=3)  # nothing launched outside: nothing to disagree with


@pytest.mark.parametrize("world", [(0, 0, 0), (2, 2, 0), (2, -1, 0), (2, 0, -1)])
def test_set_world_rejects_impossible_ranks(world):
    with pytest.raises(ValueError, match="set_world"):
        LocalEnvironment().set_world(*world)


def test_plain_run_reads_master_and_node_rank_from_the_user(env):
    env(MASTER_ADDR="192.168.1.2", MASTER_PORT="4000", NODE_RANK="1")
    environment = detect_environment()
    assert type(environment) is LocalEnvironment and not environment.creates_processes_externally
    assert (environment.main_address, environment.main_port, environment.node_rank()) == ("192.168.1.2", 4000, 1)
    environment.validate(num_nodes=2, devices_per_node=4)


def test_plain_run_on_several_nodes_needs_the_variables_that_join_them(env):
    with pytest.raises(ValueError, match="num_nodes=2 needs a launcher .*MASTER_ADDR, MASTER_PORT, NODE_RANK not set"):
        LocalEnvironment().validate(num_nodes=2, devices_per_node=1)
    env(MASTER_ADDR="10.0.0.1", MASTER_PORT="4000", NODE_RANK="2")
    with pytest.raises(ValueError, match="NODE_RANK=2 but num_nodes=2: give each node a NODE_RANK from 0 to 1"):
        LocalEnvironment().validate(num_nodes=2, devices_per_node=1)


def test_free_port_can_be_bound_and_no_outgoing_connection_can_take_it():
    state = random.getstate()
    ports = [find_free_port() for _ in range(20)]
    assert random.getstate() == state, "choosing a port must leave the user's random state alone"
    with socket.socket() as sock:
        sock.bind(("", ports[0]))
    assert all(FIRST_CHOSEN_PORT <= port < outgoing_ports_start() for port in ports)
    assert len(set(ports)) > 1


def test_a_port_is_still_found_where_no_room_lies_below_the_outgoing_ports(tmp_path, monkeypatch):
    (tmp_path / "range").write_text("1024\t65535\n")
    monkeypatch.setattr(environments, "OUTGOING_PORTS_FILE", str(tmp_path / "range"))
    assert environments.outgoing_ports_start() == 1024
    with socket.socket() as sock:
        sock.bind(("", find_free_port()))


def test_bad_port_is_named(env):
    env(MASTER_PORT="http")
    with pytest.raises(RuntimeError, match="MASTER_PORT='http' should be an integer"):
        LocalEnvironment().main_port


# ---------------------------------------------------------------- child of easyfit's own launcher
def test_child_disagreeing_with_fit(env):
    env(CHILD)
    assert detect_environment().name == "easyfit's launcher"
    with pytest.raises(ValueError, match="every process must call fit with the same devices= and num_nodes="):
        detect_environment().validate(num_nodes=1, devices_per_node=4)


def test_child_missing_a_variable_says_which(env, monkeypatch):
    env(CHILD)
    monkeypatch.delenv("RANK")
    with pytest.raises(RuntimeError, match="easyfit's launcher started this process but the environment variable "
                                           "RANK is not set"):
        detect_environment().global_rank()


def test_launched_flag_must_be_one(env):
    env(CHILD, **{LAUNCHED_RANK_VARIABLE: "0"})
    assert not detect_environment().creates_processes_externally


# ---------------------------------------------------------------- torchrun
def test_torchrun_world_mismatch_says_both_fixes(env):
    env(TORCHRUN)
    with pytest.raises(ValueError) as error:
        detect_environment().validate(num_nodes=2, devices_per_node=2)
    assert str(error.value) == (
        "torchrun started 8 processes (2 per node) but fit asks for num_nodes=2 × devices=2 = 4 processes; "
        "run torchrun --nnodes=2 --nproc-per-node=2 on each node, or pass num_nodes=4, devices=2 to fit.")


def test_torchrun_one_process_in_the_singular(env):
    env(TORCHRUN, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", GROUP_RANK="0", LOCAL_WORLD_SIZE="1")
    with pytest.raises(ValueError, match=r"torchrun started 1 process \(1 per node\) .* or pass devices=1 to fit"):
        detect_environment().validate(num_nodes=1, devices_per_node=2)


def test_torchrun_without_master_addr_says_so(env, monkeypatch):
    env(TORCHRUN)
    monkeypatch.delenv("MASTER_ADDR")
    with pytest.raises(RuntimeError, match="torchrun started this process but the environment variable MASTER_ADDR"):
        detect_environment().main_address


# ---------------------------------------------------------------- deepspeed launcher
def test_deepspeed_mismatch_fix(env):
    env(DEEPSPEED)
    with pytest.raises(ValueError, match="run deepspeed --num_nodes=1 --num_gpus=4, or pass num_nodes=2, devices=4"):
        detect_environment().validate(num_nodes=1, devices_per_node=4)


def test_ranks_alone_are_not_the_deepspeed_launcher(env):
    env(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="1")
    assert type(detect_environment()) is LocalEnvironment


# ---------------------------------------------------------------- mpirun / horovodrun
def test_mpi_address_and_port(env, monkeypatch):
    env(HOROVOD_GLOO)
    assert MPIEnvironment().main_address == "10.0.0.5"
    env(MASTER_PORT="3000")
    assert MPIEnvironment().main_port == 3000
    env(OPEN_MPI)
    for name in HOROVOD_GLOO:
        monkeypatch.delenv(name)
    with pytest.raises(RuntimeError, match=r"does not say where rank 0 runs.*mpirun -x MASTER_ADDR=\$\(hostname\)"):
        MPIEnvironment().main_address
    env(OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_RANK="2", OMPI_COMM_WORLD_LOCAL_RANK="2")
    assert MPIEnvironment().main_address == "127.0.0.1"  # every rank on this node


def test_mpi_mismatch_fix(env):
    env(OPEN_MPI)
    with pytest.raises(ValueError, match=r"MPI started 8 processes \(4 per node\) .*= 16 processes; start 16 "
                                         r"processes, 8 per node \(mpirun -np 16 --npernode 8 .*or pass devices=4"):
        detect_environment().validate(num_nodes=2, devices_per_node=8)


def test_pmi_rank_alone_is_not_mpirun(env):
    env(PMI_RANK="0", PMI_SIZE="2")
    assert type(detect_environment()) is LocalEnvironment
    with pytest.raises(RuntimeError, match="rank variables of mpirun or horovodrun"):
        MPIEnvironment()


# ---------------------------------------------------------------- SLURM
def test_slurm_master_variables_win(env):
    env(SLURM, MASTER_ADDR="10.1.1.1", MASTER_PORT="5555")
    assert (SLURMEnvironment().main_address, SLURMEnvironment().main_port) == ("10.1.1.1", 5555)


def test_slurm_nodelist_falls_back_and_is_required(env, monkeypatch):
    env(SLURM, SLURM_NODELIST="gpu[7-8]")
    monkeypatch.delenv("SLURM_JOB_NODELIST")
    assert SLURMEnvironment().main_address == "gpu7"
    monkeypatch.delenv("SLURM_NODELIST")
    with pytest.raises(RuntimeError, match="SLURM_NODELIST is not set"):
        SLURMEnvironment().main_address


@pytest.mark.parametrize("variables", [{"SLURM_JOB_NAME": "bash"}, {"SLURM_JOB_NAME": "interactive"},
                                       {"SLURM_NTASKS": "1"}, {"SLURM_NTASKS": ""}])
def test_slurm_leaves_interactive_and_one_task_jobs_to_easyfit(env, variables):
    env(SLURM, **variables)
    assert type(detect_environment()) is LocalEnvironment


def test_slurm_validate_says_what_to_change(env):
    env(SLURM, SLURM_NTASKS="4", SLURM_NNODES="2")
    with pytest.raises(ValueError) as error:
        SLURMEnvironment().validate(num_nodes=2, devices_per_node=4)
    assert str(error.value) == (
        "SLURM started 4 tasks (2 per node) but fit asks for num_nodes=2 × devices=4 = 8 processes; "
        "set #SBATCH --nodes=2 and #SBATCH --ntasks-per-node=4, or pass devices=2 to fit.")


def test_slurm_validate_catches_a_wrong_split_over_nodes(env):
    env(SLURM)
    with pytest.raises(ValueError, match=r"8 tasks \(4 per node\) .* num_nodes=1 × devices=8 = 8 processes.*"
                                         r"or pass num_nodes=2, devices=4 to fit"):
        SLURMEnvironment().validate(num_nodes=1, devices_per_node=8)


def test_slurm_without_node_count_checks_the_total(env, monkeypatch):
    env(SLURM)
    monkeypatch.delenv("SLURM_NNODES")
    assert SLURMEnvironment().local_world_size() is None
    SLURMEnvironment().validate(num_nodes=1, devices_per_node=8)
    env(SLURM_JOB_NUM_NODES="2")
    assert SLURMEnvironment().local_world_size() == 4


@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("node[001-003,007],gpu5", ["node001", "node002", "node003", "node007", "gpu5"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("gpu[3]", ["gpu3"]),
    ("a,b.example.org", ["a", "b.example.org"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("c[1-2],d[5,7]e", ["c1", "c2", "d5e", "d7e"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["", "node[1-", "node[a-b]", "n[1-2],,m", "n[1-2]]", "n[[1]]", "n[1-2-3]"])
def test_unreadable_nodelist_suggests_master_addr(nodelist):
    with pytest.raises(ValueError, match="set MASTER_ADDR to the first node's address"):
        expand_nodelist(nodelist)


# ---------------------------------------------------------------- precedence
@pytest.mark.parametrize("tables, winner", [
    ((CHILD, TORCHRUN, SLURM, OPEN_MPI), LocalEnvironment),
    ((TORCHRUN, DEEPSPEED, SLURM, OPEN_MPI), TorchElasticEnvironment),
    ((DEEPSPEED, SLURM, OPEN_MPI), DeepSpeedEnvironment),
    ((TORCHRUN, RAY_WORKER), TorchElasticEnvironment),   # torchrun run inside a Ray task
    ((RAY_WORKER, SLURM, OPEN_MPI), RayEnvironment),   # a Ray cluster inside a SLURM job
    ((OPEN_MPI, SLURM), MPIEnvironment),
    ((HOROVOD_GLOO, SLURM), MPIEnvironment),
    ((SLURM,), SLURMEnvironment),
])
def test_the_launcher_of_this_process_wins(env, tables, winner):
    env(*tables)
    environment = detect_environment()
    assert type(environment) is winner and environment.creates_processes_externally


def test_a_model_knows_its_rank_from_the_launcher_before_its_first_call(env):
    env(CHILD)
    model = easyfit.Model(torch.nn.Linear(2, 2))
    assert (model.global_rank, model.world_size, model.is_global_zero) == (3, 4, False)


# ---------------------------------------------------------------- a Ray Train worker
def test_a_ray_train_worker_says_its_ranks(env):
    env(RAY_WORKER)
    environment = detect_environment()
    assert isinstance(environment, RayEnvironment) and not environment.launched_by_easyfit
    assert (environment.world_size(), environment.global_rank(), environment.local_rank(), environment.node_rank(),
            environment.local_world_size()) == (4, 3, 1, 1, 2)
    assert (environment.main_address, environment.main_port) == ("10.0.0.2", 52761)


def test_a_call_in_a_users_worker_takes_rays_ranks_and_starts_no_process(env):
    env(RAY_WORKER)
    strategy = connect(strategy="ddp", accelerator="cpu", num_nodes=2)
    assert (strategy.world_size, strategy.global_rank, strategy.num_processes) == (4, 3, 2)
    assert strategy.make_launcher() is None   # the user's TorchTrainer started the ranks, and restarts them
    with pytest.raises(ValueError, match=r"Ray Train started 4 workers \(2 per node\) but fit asks for num_nodes=1"):
        connect(strategy="ddp", accelerator="cpu", devices=2)


def test_a_worker_of_launcher_ray_is_easyfits_own_wherever_ray_placed_it(env):
    env(RAY_WORKER, EASYFIT_RAY_LAUNCHED="1", LOCAL_WORLD_SIZE="3")   # Ray put 3 of the 4 workers on this node
    strategy = connect(strategy="fsdp", accelerator="cpu", num_nodes=2)
    assert isinstance(strategy.make_launcher(), RelaunchedRankLauncher)   # restarts and fault tolerance: easyfit's
    assert (strategy.world_size, strategy.global_rank, strategy.num_processes) == (4, 3, 3)
    env(EASYFIT_RAY_LAUNCHED="0")   # a user's own TorchTrainer: its workers must be the call's
    with pytest.raises(ValueError, match=r"Ray Train started 4 workers \(3 per node\)"):
        connect(strategy="fsdp", accelerator="cpu", num_nodes=2)


def test_launcher_ray_is_planned_before_ray_starts_from_a_notebook_and_a_cpu_head_node(monkeypatch):
    pytest.importorskip("ray.train", reason='launcher="ray" needs Ray Train: pip install "easyfit[ray]"')
    monkeypatch.setattr("sys.ps1", ">>> ", raising=False)   # a notebook or REPL: ddp could not re-run it
    model = easyfit.Model(torch.nn.Linear(4, 1), loss="mse")
    run = RunOptions(devices=2, num_nodes=3, strategy="ddp", accelerator="gpu", launcher="ray")
    options = LoopOptions(batch_size=32, verbose=0, callbacks=None)
    plan = plan_call(model, EVALUATE, run, options)
    assert plan.rank_zero_elsewhere and plan.launcher.num_workers == 6 and plan.launcher.accelerator == "gpu"
    assert plan.strategy.num_nodes == 1   # the workers resolve the nodes; the caller only checks
    sized = plan_call(model, PREDICT, run.replace(launcher=easyfit.launchers.Ray(num_workers=5)), options)
    assert sized.launcher.num_workers == 5
    with pytest.raises(ValueError, match="launcher='ray' runs fit, evaluate and predict"):
        plan_call(model, FIND_BATCH_SIZE, run)
