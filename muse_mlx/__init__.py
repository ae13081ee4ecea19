"""muse_mlx: an MLX reimplementation of the Muser inference engine for Muse Glimmer."""

__version__ = "0.1.0"
