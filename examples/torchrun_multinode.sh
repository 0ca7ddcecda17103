#!/usr/bin/env bash
# Start an easyfit training script under torchrun on this node; run the same line on every node of the job.
#
#   on node0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 examples/torchrun_multinode.sh train.py --epochs 10
#   on node1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 examples/torchrun_multinode.sh train.py --epochs 10
#
# The script calls fit with strategy="ddp" (or "auto") and the same shape that torchrun starts:
#   model.fit(x, y, batch_size=64, strategy="ddp", num_nodes=NNODES, devices=NPROC_PER_NODE)   # or devices="auto"
# devices="auto" adopts the processes torchrun started on each node; num_nodes must be given (fit checks that
# torchrun's world size equals num_nodes × devices and says what to change if not).
#
# Try it on one machine, 2 CPU processes:  NPROC_PER_NODE=2 examples/torchrun_multinode.sh examples/ddp_cpu.py
set -euo pipefail

NNODES=${NNODES:-1}                      # machines in the job
NODE_RANK=${NODE_RANK:-0}                # this machine: 0 .. NNODES-1 (node 0 hosts the rendezvous)
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}    # address of node 0, reachable from every node
MASTER_PORT=${MASTER_PORT:-29500}        # a free TCP port on node 0
# one process per GPU by default; on a CPU-only machine set NPROC_PER_NODE (processes per node)
NPROC_PER_NODE=${NPROC_PER_NODE:-$(python -c 'import torch; print(torch.cuda.device_count() or 1)')}

exec python -m torch.distributed.run \
    --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
    --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    "$@"
