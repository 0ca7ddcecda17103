"""The user's data as batches: arrays, datasets, loaders and iterables to batches on a device.

- `source`: the batch-source protocol every batch source and wrapper follows (`BatchSource`, `WrappedBatches`).
- `batches`: what the user passes, turned into batches; validation splits.
- `samplers`: every sample once per epoch, in an order set by (seed, epoch).
- `contents`: what a batch holds (inputs, target, sample count) and moving it to a device.
- `predict_inputs`, `results`: what predict passes to the net, and what evaluate / predict hand back.
- `weights`: sample and class weights.
- `steps`: steps_per_epoch / validation_steps over any data.
- `explain`: what goes wrong on a first batch, in words.
"""
