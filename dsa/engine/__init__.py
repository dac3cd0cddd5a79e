"""The DSA serving engine: continuous batching, chunked prefill, paged cache blocks, CUDA-graph
decode and per-stage timing (see :mod:`dsa.engine.engine`)."""
from .block_manager import BlockManager
from .cuda_graph import DecodeGraphRunner, default_buckets, graph_unsupported_reason
from .engine import CheckRecord, Engine, EngineConfig, StepRecord
from .profiler import STAGES, StageProfiler
from .scheduler import Request, Scheduler, SchedulerConfig

__all__ = ["BlockManager", "DecodeGraphRunner", "default_buckets", "graph_unsupported_reason", "Engine",
           "EngineConfig", "StepRecord", "CheckRecord", "StageProfiler", "STAGES", "Request", "Scheduler",
           "SchedulerConfig"]
