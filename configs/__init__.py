"""The Hydra configs of taac-train, shipped in the wheel as the package runtime.configs."""
