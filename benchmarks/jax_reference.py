"""W1 of benchmarks/overhead.py written by hand in JAX: the limit a compiled step can reach on this CPU.

    python benchmarks/jax_reference.py [--epochs N]

The MLP 32-64-10 (ReLU, PyTorch's initialisation ranges), SGD at lr 0.01 with cross-entropy, 20,000 samples in
batches of 64 shuffled each epoch, on one CPU thread, trained two ways:
  step  a jitted step (forward, loss, gradient, update) called from a Python loop over the batches
  scan  the whole epoch as one jitted `lax.scan` over the batches
Each prints the fastest epoch's seconds. overhead.py calls `epoch_seconds()` when jax is installed and prints each
W1 row's ratio to the scan. Only jax is needed (the update is SGD's `w - lr * g`, as optax.sgd computes it).
"""
from __future__ import annotations

import argparse
import os
import time

SAMPLES, BATCH, SIZES, LR = 20_000, 64, (32, 64, 10), 0.01


def _one_thread() -> None:
    """XLA's CPU client on one thread, as the PyTorch side runs (set before jax is imported)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "intra_op_parallelism_threads" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false "
                                   "intra_op_parallelism_threads=1").strip()


def epoch_seconds(epochs: int = 5) -> dict[str, float]:
    """{"step": seconds, "scan": seconds}: the fastest of `epochs` epochs after a compiling one, each way."""
    _one_thread()
    import jax
    import jax.numpy as jnp
    import numpy as np

    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    params = []
    for index, (fan_in, fan_out) in enumerate(zip(SIZES, SIZES[1:])):
        bound = 1 / fan_in ** 0.5
        params.append((jax.random.uniform(keys[2 * index], (fan_in, fan_out), minval=-bound, maxval=bound),
                       jax.random.uniform(keys[2 * index + 1], (fan_out,), minval=-bound, maxval=bound)))
    x = jax.random.normal(keys[6], (SAMPLES, SIZES[0]))
    y = jax.random.randint(keys[7], (SAMPLES,), 0, SIZES[-1])
    full = SAMPLES // BATCH * BATCH   # whole batches (the scan needs equal shapes)

    def loss_of(params, xb, yb):
        hidden = xb
        for weight, bias in params[:-1]:
            hidden = jax.nn.relu(hidden @ weight + bias)
        logits = hidden @ params[-1][0] + params[-1][1]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None], axis=1))

    def update(params, xb, yb):
        grads = jax.grad(loss_of)(params, xb, yb)
        return jax.tree_util.tree_map(lambda w, g: w - LR * g, params, grads)

    step = jax.jit(lambda params, idx: update(params, x[idx], y[idx]))   # the batch is gathered in the step

    @jax.jit
    def scan_epoch(params, order):
        xs = x[order[:full]].reshape(-1, BATCH, SIZES[0])
        ys = y[order[:full]].reshape(-1, BATCH)
        return jax.lax.scan(lambda p, batch: (update(p, *batch), None), params, (xs, ys))[0]

    def run_steps(params, order):
        for idx in np.asarray(order[:full]).reshape(-1, BATCH):   # host index arrays: no JAX op per slice
            params = step(params, idx)
        return params

    results = {}
    for name, run in (("step", run_steps), ("scan", scan_epoch)):
        times, state = [], params
        for epoch in range(epochs + 1):
            order = jax.random.permutation(jax.random.PRNGKey(epoch), SAMPLES)
            started = time.perf_counter()
            state = jax.block_until_ready(run(state, order))
            if epoch:   # epoch 0 compiles
                times.append(time.perf_counter() - started)
        results[name] = min(times)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description="W1 of benchmarks/overhead.py in JAX")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    for name, seconds in epoch_seconds(args.epochs).items():
        print(f"JAX W1 {name}: {seconds:.4f} s per epoch ({seconds / (SAMPLES // BATCH) * 1e6:.1f} µs per step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
