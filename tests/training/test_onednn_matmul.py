"""A compiled CPU program's float32 matrix products through oneDNN (easyfit.compiled.onednn_matmul): the same
numbers as torch's `mm` and as an eager fit, the op swapped in only where it should be.

Which library is faster depends on the CPU, so the fits force the choice: `onednn_is_faster` answering True (or
False) is the one decision replaced; the products, the compiled programs and the fits are real."""
from __future__ import annotations

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
from compile_paths import fast_path
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import easyfit
from easyfit.compiled import onednn_matmul

pytestmark = pytest.mark.skipif(not onednn_matmul.available(), reason="this torch build has no oneDNN CPU kernels")


@pytest.fixture(autouse=True)
def _compile_anew():
    """No compiled graph from inductor's caches: each fit's programs go through the pass with its forced choice.
    Set through torch's own config patches, which put every option back as it was."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.mark.parametrize("a_transposed", [False, True])
@pytest.mark.parametrize("b_transposed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_equals_mm(a_transposed, b_transposed, bias):
    torch.manual_seed(0)
    a = torch.randn(96, 64).t() if a_transposed else torch.randn(64, 96)
    b = torch.randn(48, 96).t() if b_transposed else torch.randn(96, 48)
    row = torch.randn(48) if bias else None
    expected = torch.addmm(row, a, b) if bias else torch.mm(a, b)
    result = torch.ops.easyfit.onednn_mm(a, b, row)
    assert result.shape == (64, 48) and result.is_contiguous()
    torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)


def test_small_products_are_not_timed_and_stay_with_mm(monkeypatch):
    monkeypatch.setattr(onednn_matmul, "_times_faster", lambda *shape: pytest.fail("a small product was timed"))
    assert not onednn_matmul.onednn_is_faster.__wrapped__(64, 32, 64, False, False, True)


@pytest.mark.parametrize("long, calls", [(10.0, 6), (0.0, 2)], ids=["fast", "slow"])
def test_a_slow_product_is_timed_once_after_its_warm_up(monkeypatch, long, calls):
    monkeypatch.setattr(onednn_matmul, "LONG", long)
    made = []
    onednn_matmul._best_time(lambda: made.append(torch.mm(torch.ones(4, 4), torch.ones(4, 4))))
    assert len(made) == calls


def test_timing_a_product_draws_none_of_the_fits_random_numbers():
    state = torch.random.get_rng_state()
    onednn_matmul.onednn_is_faster.__wrapped__(128, 96, 128, True, False, True)
    assert torch.equal(torch.random.get_rng_state(), state)


def _graph(function, *tensors) -> torch.fx.Graph:
    return make_fx(function, tracing_mode="fake")(*tensors).graph


def _targets(graph: torch.fx.Graph) -> list:
    return [node.target for node in graph.nodes if node.op == "call_function"]


def test_the_pass_swaps_float32_products_and_a_bias_row_only(monkeypatch):
    monkeypatch.setattr(onednn_matmul, "onednn_is_faster", lambda *shape: True)
    swap = onednn_matmul.OneDnnMatmuls()

    def products(x, w, b, full, one):
        return torch.addmm(b, x, w.t()), torch.mm(x, w.t()), torch.addmm(full, x, w.t()), \
            torch.addmm(b, x, w.t(), beta=0.5), torch.mm(x.bfloat16(), w.t().bfloat16()), torch.addmm(one, x, w.t())
    graph = _graph(products, torch.randn(8, 4), torch.randn(6, 4), torch.randn(6), torch.randn(8, 6), torch.randn(1))
    swap(graph)
    targets = _targets(graph)
    assert targets.count(torch.ops.easyfit.onednn_mm.default) == 2
    assert targets.count(torch.ops.aten.addmm.default) == 3   # a full matrix added, beta=0.5, a broadcast number
    assert targets.count(torch.ops.aten.mm.default) == 1      # bfloat16


def test_the_pass_leaves_products_where_onednn_is_not_faster(monkeypatch):
    monkeypatch.setattr(onednn_matmul, "onednn_is_faster", lambda *shape: False)
    graph = _graph(lambda x, w: torch.mm(x, w), torch.randn(8, 4), torch.randn(4, 6))
    onednn_matmul.OneDnnMatmuls()(graph)
    assert _targets(graph) == [torch.ops.aten.mm.default]


def test_a_product_with_a_dynamic_size_keeps_mm_untimed():
    """Batches of changing length make a size symbolic (a SymInt, which the timing cache cannot key on)."""
    graph = make_fx(lambda x, w: torch.mm(x, w), tracing_mode="symbolic")(torch.randn(300, 256),
                                                                         torch.randn(256, 256)).graph
    onednn_matmul.OneDnnMatmuls()(graph)
    assert _targets(graph) == [torch.ops.aten.mm.default]


RATES = {"sgd": 0.05, "rmsprop": 1e-3}


def _fit(compile, optimizer):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(48, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 5))
    x, y = torch.randn(200, 48), torch.randint(0, 5, (200,))
    model = easyfit.Model(net, "cross_entropy", optimizer, metrics=["accuracy"], lr=RATES[optimizer])
    with torch.profiler.profile() as profile:
        history = model.fit(x, y, epochs=2, batch_size=32, validation_split=0.2, verbose=0, compile=compile,
                            devices=1, shuffle=False)
    calls = sum(event.name == "easyfit::onednn_mm" for event in profile.events())
    return model, history.history, calls


@fast_path
@pytest.mark.parametrize("optimizer", ["sgd", "rmsprop"])   # one program per step; forward+loss and step apart
def test_a_compiled_fit_through_onednn_equals_the_eager_fit(monkeypatch, optimizer):
    monkeypatch.setattr(onednn_matmul, "onednn_is_faster", lambda *shape: True)
    eager, eager_history, eager_calls = _fit(False, optimizer)
    compiled, history, calls = _fit(True, optimizer)
    assert eager_calls == 0 and calls > 0
    for (name, expected), actual in zip(eager.net.state_dict().items(), compiled.net.state_dict().values()):
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5, msg=name)
    for key, values in eager_history.items():
        assert history[key] == pytest.approx(values, abs=1e-5), key


@pytest.mark.parametrize("faster, compile", [(False, True), (True, {"options": {"post_grad_custom_post_pass": None}})],
                         ids=["onednn-not-faster", "turned-off"])
def test_a_compiled_fit_keeps_mm(monkeypatch, faster, compile):
    monkeypatch.setattr(onednn_matmul, "onednn_is_faster", lambda *shape: faster)
    assert _fit(compile, "sgd")[2] == 0
