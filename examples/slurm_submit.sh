#!/bin/bash
# Submit an easyfit training script to SLURM: 2 nodes × 4 GPUs = 8 processes, one SLURM task per GPU.
#
#   sbatch examples/slurm_submit.sh
#
# train.py calls fit with the job's shape; fit checks SLURM_NTASKS == num_nodes × devices and says what to change:
#   model.fit(train_ds, epochs=10, batch_size=64, strategy="ddp", num_nodes=2, devices=4)   # effective batch 512
# SLURM starts every process (srun), so easyfit starts none: each task reads its rank from SLURM_PROCID,
# SLURM_LOCALID and SLURM_NODEID; the main address is the job's first node, the port is derived from the job id
# (set MASTER_ADDR / MASTER_PORT to override).
#
#SBATCH --job-name=easyfit-ddp
#SBATCH --nodes=2                 # = num_nodes in fit
#SBATCH --ntasks-per-node=4       # = devices in fit: one task per GPU
#SBATCH --gres=gpu:4              # every task sees all 4 GPUs of its node and takes the one of its local rank
#SBATCH --cpus-per-task=8
#SBATCH --mem=0                   # all of each node's memory
#SBATCH --time=02:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail

# activate the environment that has easyfit installed (a venv here; `conda activate NAME` works the same)
source "${VENV:-$HOME/venvs/easyfit}/bin/activate"

export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}   # threads per process: the task's cores, not the node's

srun python train.py --epochs 10
