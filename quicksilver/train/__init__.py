"""Training: objectives (masked diffusion, block diffusion, next-token), packing, the loop, checkpoints, DDP."""

from quicksilver.train.loop import TrainOptions, TrainResult, export_checkpoint, train
from quicksilver.train.recipe import Recipe

__all__ = ["Recipe", "TrainOptions", "TrainResult", "export_checkpoint", "train"]
