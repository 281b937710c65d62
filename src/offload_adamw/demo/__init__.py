"""The main job, ``offload-adamw demo``: a byte-level Llama trained four ways on the standard library's sources."""

from offload_adamw.demo.runs import DemoConfig, RunResult, run_demo

__all__ = ["DemoConfig", "RunResult", "run_demo"]
