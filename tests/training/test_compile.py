"""fit / evaluate / predict with compile=...: eager's numbers, and nothing recompiles after the first epoch."""
from __future__ import annotations

import math

import pytest
import torch
from compile_paths import fast_path
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

import easyfit
from easyfit.callbacks import Callback
from easyfit.compiled import functional_step, settings
from easyfit.compiled.settings import compile_settings
from easyfit.compiled.steps import LearningRatesInTensors
from easyfit.utils.torch_internals import mode_names


class FramesPerEpoch(Callback):
    """How many frames the counting backend had compiled at the end of each epoch."""

    def __init__(self, counter: CompileCounter):
        self.counter, self.counts = counter, []

    def on_epoch_end(self, epoch, logs=None):
        self.counts.append(self.counter.frame_count)


class GraphsPerEpoch(Callback):
    """How many graphs torch.compile had made at the end of each epoch (any backend)."""

    def __init__(self):
        self.counts = []

    def on_epoch_end(self, epoch, logs=None):
        self.counts.append(counters["stats"]["unique_graphs"])


def _fit(make_net, data, compile, device="cpu", eps=1e-8, **options):
    x, y = data
    model = easyfit.Model(make_net(), "cross_entropy", "adam", metrics=["accuracy"], lr=0.01, eps=eps,
                          scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5))
    run = {"compile": compile, "accelerator": device, "devices": 1}
    history = model.fit(x, y, epochs=2, batch_size=32, verbose=0, validation_data=(x[:50], y[:50]),
                        lr_warmup_epochs=1, **run, **options)   # the LR changes every step, then every epoch
    scores = model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True, **run)
    return model, history.history, scores, model.predict(x, batch_size=32, **run)


def _assert_close(eager, compiled, atol: float) -> None:
    (eager_model, eager_history, eager_scores, eager_outputs) = eager
    (model, history, scores, outputs) = compiled
    for (name, expected), actual in zip(eager_model.net.state_dict().items(), model.net.state_dict().values()):
        assert (actual.cpu() - expected.cpu()).abs().max().item() <= atol, name
    for key, values in eager_history.items():
        assert history[key] == pytest.approx(values, abs=atol), key
    assert scores == pytest.approx(eager_scores, abs=atol)
    assert (outputs - eager_outputs).abs().max().item() <= atol


def test_compiled_with_inductor_matches_eager_within_1e_5(make_net, classification):
    """101 samples in batches of 32: the short last batch runs eagerly, every sample counts, and the compiled
    forward, backward and Adam step (with its LR changed by warmup and a schedule) give eager's numbers. The mode
    of CUDA graphs ("reduce-overhead", none on a CPU) also takes the path that copies each loss out of the graph."""
    eager = _fit(make_net, classification, compile=False)
    _assert_close(eager, _fit(make_net, classification, compile="reduce-overhead"), 1e-5)


def test_nothing_recompiles_after_the_first_epoch(make_net, classification):
    """Learning rates changing every step, the short last batch, validation and a second fit compile nothing new."""
    counter = CompileCounter()
    frames = FramesPerEpoch(counter)
    model, _, _, _ = _fit(make_net, classification, compile={"backend": counter}, callbacks=[frames])
    first_epoch = frames.counts[0]
    assert first_epoch > 0 and frames.counts == [first_epoch, first_epoch]
    compiled = counter.frame_count   # with evaluate's and predict's
    model.fit(*classification, epochs=3, batch_size=32, verbose=0, compile={"backend": counter}, devices=1)
    assert counter.frame_count == compiled


@pytest.mark.parametrize("mode", [mode for mode in mode_names() if mode not in ("default", "reduce-overhead")])
def test_every_mode_torch_lists_trains_with_eagers_numbers(make_net, classification, mode):
    """Each mode the running torch lists (default and reduce-overhead: above) gives eager's numbers, on compile='s
    fast path and on its fallback (plain torch.compile) alike."""
    _assert_close(_fit(make_net, classification, compile=False), _fit(make_net, classification, compile=mode), 1e-5)


def test_a_mode_with_options_is_refused_for_a_backend_that_takes_one_of_them(make_net, classification):
    with pytest.raises(ValueError, match="gives both a mode and options"):
        easyfit.Model(make_net()).fit(*classification, verbose=0,
                                      compile={"backend": "aot_eager", "mode": "default", "options": {"a": 1}})


@pytest.mark.parametrize("value, error, words", [
    ("fastest", ValueError, "not a torch.compile mode"),
    ({"mode": "default", "speed": 2}, ValueError, "unknown option(s) 'speed'"),
    (1.5, TypeError, "compile must be True, False"),
])
def test_a_malformed_compile_option_is_refused_by_name(make_net, classification, value, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        easyfit.Model(make_net()).fit(*classification, verbose=0, compile=value)


def test_a_strategy_that_cannot_compile_says_so_before_training(make_net, classification):
    net = make_net()
    before = {name: value.clone() for name, value in net.state_dict().items()}
    with pytest.raises(ValueError, match="does not support compile=True"):
        easyfit.Model(net).fit(*classification, verbose=0, compile=True, strategy=easyfit.strategies.Strategy())
    assert all(torch.equal(before[name], value) for name, value in net.state_dict().items())


def test_cuda_graphs_with_gradient_accumulation_are_refused(make_net, classification):
    with pytest.raises(ValueError, match="overwrites the gradients"):
        easyfit.Model(make_net()).fit(*classification, verbose=0, compile="reduce-overhead",
                                      gradient_accumulation_steps=2)


def test_compile_settings_map_the_option_to_torch_compile_arguments():
    assert compile_settings(False) is None and compile_settings(None) is None
    assert compile_settings(True) == {}
    assert compile_settings("max-autotune") == {"mode": "max-autotune"}
    assert compile_settings({"backend": "eager", "fullgraph": True}) == {"backend": "eager", "fullgraph": True}


def test_learning_rates_are_tensors_only_while_the_compiled_step_runs():
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([{"params": [weight]}, {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 2.0}],
                                lr=0.5)
    rates = LearningRatesInTensors(optimizer)
    held = list(rates.tensors)
    optimizer.param_groups[0]["lr"] = 0.25   # what a schedule does between steps
    with rates:
        assert [group["lr"] for group in optimizer.param_groups] == held   # the same tensors: no recompile
        assert [float(tensor) for tensor in held] == [0.25, 2.0]
    assert [group["lr"] for group in optimizer.param_groups] == [0.25, 2.0]


@pytest.mark.gpu
def test_a_compiled_fit_continues_an_eager_one_on_a_gpu(make_net, classification):
    """Adam's state, made eagerly (not capturable), and a learning rate held in a tensor step together."""
    model = easyfit.Model(make_net(), "cross_entropy", "adam")
    for compile in (False, "reduce-overhead", True):
        history = model.fit(*classification, epochs=2, verbose=0, accelerator="cuda", devices=1, compile=compile)
        assert all(math.isfinite(loss) for loss in history.history["loss"])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["reduce-overhead", True])
def test_compiled_on_a_gpu_matches_eager_within_1e_5(make_net, classification, mode):
    """CUDA graphs ("reduce-overhead") replay the forward, backward and capturable Adam step; fp32 numbers equal
    eager's (float32 matrix products stay IEEE: torch's default, no TF32). Adam's eps is 1e-3 here: with 1e-8 an
    update is lr times the sign of any gradient element near 0, so a last-bit difference between GPU kernels moves a
    weight by up to twice the LR (an H200 run once ended 4.5e-3 apart; the next, same compiled path, 2.7e-7)."""
    eager = _fit(make_net, classification, compile=False, device="cuda", eps=1e-3)
    graphs = GraphsPerEpoch()
    _assert_close(eager, _fit(make_net, classification, compile=mode, device="cuda", eps=1e-3, callbacks=[graphs]),
                  1e-5)
    assert graphs.counts[0] > 0 and graphs.counts[1] == graphs.counts[0]   # nothing compiled in the second epoch


@fast_path
def test_the_hand_off_from_parts_to_programs_under_cuda_graphs_keeps_eager_s_numbers(make_net, classification,
                                                                                     monkeypatch):
    """Under CUDA graphs the first step's gradients live in the graphs' pool, so the whole-step programs take over
    with them dropped, and each compiled forward's outputs are copied (predict keeps them).
    A GPU alone shows the overwritten pool; here the same code runs with a mode taken for a CUDA-graph one, and
    must give eager's numbers."""
    monkeypatch.setattr(settings, "CUDA_GRAPH_MODES", ("default",))
    hand_offs = []
    leave = functional_step.leave_graph_pool
    monkeypatch.setattr(functional_step, "leave_graph_pool", lambda *args: hand_offs.append(leave(*args)))
    _assert_close(_fit(make_net, classification, compile=False),
                  _fit(make_net, classification, compile="default"), 1e-5)
    assert len(hand_offs) == 2   # one an epoch


def test_a_step_compiled_in_parts_draws_eager_dropout_masks(make_net, classification):
    """Adagrad's update is not traced into a whole-step program, so the forward and loss, and the optimizer step,
    are compiled apart; with inductor's fallback_random the Dropout masks are still eager's."""
    def fit(compile):
        torch.manual_seed(3)
        model = easyfit.Model(make_net(dropout=0.3), "cross_entropy", "adagrad", lr=0.01)
        return model, model.fit(*classification, epochs=2, batch_size=32, verbose=0, compile=compile).history
    (eager, eager_history), (compiled, history) = fit(False), fit(True)
    assert not [key for value in compiled.compiled_steps.cache.values() if isinstance(value, dict) for key in value]
    for expected, actual in zip(eager.net.state_dict().values(), compiled.net.state_dict().values()):
        assert (actual - expected).abs().max().item() <= 1e-5
    assert history["loss"] == pytest.approx(eager_history["loss"], abs=1e-5)
