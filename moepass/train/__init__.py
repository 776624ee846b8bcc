"""Pieces of the training recipe `samples/train.py` (`python -m moepass train`), each usable on its own:

- `data`: a real text corpus that ships with Python (no network), byte-tokenised, packed into sequences,
  cut into global batches in a seeded order and sliced by rank; its position is one integer (the step).
- `optim`: the optimizer (AdamW in parameter groups that never mix plain tensors and DTensors of different
  meshes, so `foreach=True` works) and the warmup + cosine learning rate.
- `checkpoint`: DCP checkpoints of model, optimizer, data position, RNG and FSEP placement tables; resume.
- `launch`: run a function on W ranks, under torchrun or by spawning them (gloo on CPU, NCCL on GPUs).
- `report`: the progress line, the JSON log and the loss-curve PNG.
"""
