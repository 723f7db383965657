"""CLI sub-commands: every public module here defines ``register(subparsers)``.

Keep module-level imports light (argparse only); import torch and friends inside the command."""
