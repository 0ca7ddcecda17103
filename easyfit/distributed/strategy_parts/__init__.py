"""What the strategies in easyfit.distributed.strategies are built from, one job a module:

- construction, meta_init, zero_init: nets built sharded from the start (module_construction()) and making them
  plain modules again;
- sharding: what the sharded strategies share (the copy of the net they train while the user's net waits on the
  host, the optimizer's parameters, rebuilding an optimizer, byte counts);
- deepspeed_config: the DeepSpeed config derived from fit's arguments and the net;
- ddp_comm, powersgd_state: DDP's communication hooks and model averaging, and their saved state;
- pipeline_split, pipeline_engine, pipeline_state: cutting an nn.Sequential into stages, running them under
  torch's pipeline schedules, and merging / splitting their state;
- tp_plan, tp_auto, tp_attention, tp_apply: tensor-parallel plans (a user's dict checked against the net, the splits
  "auto" can prove safe), an attention layer's heads split across ranks, and a plan carried out on a net;
- cpu_threads: each rank's share of the cores when easyfit starts several processes on the CPU;
- buffers: rank 0's buffers (BatchNorm's running statistics) into every rank's net at the end of a fit.
"""
