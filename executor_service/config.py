"""Executor configuration: one record built from the CLI or by a caller."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpager.channel import ClientTls
    from kvpager.server import TlsConfig

DTYPES = ("auto", "float32", "float16", "bfloat16")
BACKENDS = ("auto", "torch", "cpu", "triton")
MODEL_IMPLS = ("auto", "kvpager", "transformers")
KV_LAYOUTS = ("per-layer", "hybrid", "auto")  # executor_service.kv_layout
MAX_CUDA_GRAPH_BATCH = 1024


@dataclass(slots=True)
class ExecutorConfig:
    """How to start one executor process (or one in-process executor).

    Pool sizing precedence: ``num_blocks`` if given; else on CUDA
    ``gpu_memory_fraction`` of total device memory minus what is in use once
    the model is loaded; else (CPU) ``kv_cache_gib``.
    """

    model: str                              # local HF checkpoint directory
    executor_id: str = "executor-0"
    model_id: str | None = None             # identity sent to the memory service; default: dir name
    host: str = "127.0.0.1"
    port: int = 0                           # 0 = pick a free port
    metrics_port: int | None = None         # Prometheus; None = off
    metrics_host: str = "127.0.0.1"
    advertise_address: str | None = None    # host:port registered with memory; default host:bound port
    memory_address: str | None = None       # MemoryService host:port; None = stand-alone
    block_size: int = 16                    # tokens per block
    num_blocks: int | None = None
    kv_cache_gib: float = 0.5               # CPU pool size when num_blocks is None
    gpu_memory_fraction: float = 0.9        # CUDA pool sizing when num_blocks is None
    swap_blocks: int | None = None          # CPU swap pool; None = min(num_blocks // 2, 4 GiB worth)
    dtype: str = "auto"                     # auto: float32 on CPU, checkpoint's 16-bit dtype on CUDA
    device: str = "auto"                    # auto: cuda if available else cpu
    attention_backend: str = "auto"         # auto: triton on CUDA, cpu (C++ kernel) on CPU, else torch
    model_impl: str = "auto"                # auto: our Llama forward where it fits, else transformers' code
    max_model_len: int | None = None        # default: the model's max_position_embeddings
    kv_layout: str = "per-layer"            # per-layer | hybrid (a table per KV group) | auto (the CLI's default:
                                            # hybrid for sliding-window models); executor_service.kv_layout
    enforce_eager: bool = False             # CUDA: no decode graphs (executor_service.cuda_graphs)
    cpu_bind: bool = False                  # CPU: bind the step's threads one per core (executor_service.cpu);
                                            # the CLI turns it on, an in-process caller's threads are its own
    huge_pages: bool = True                 # CPU: the KV pool on transparent huge pages (executor_service.huge_pages)
    cuda_graph_max_batch: int = 256         # CUDA: the largest decode batch captured as a graph
    grace_s: float = 5.0                    # graceful-stop window
    register_backoff_max_s: float = 5.0     # registration retry ceiling
    tls: TlsConfig | None = None            # serve TLS (mTLS with require_client_auth); None = insecure
    client_tls: ClientTls | None = None     # TLS to the memory service; None = insecure
    # Between services: required on Execute/GetInfo/ConfirmPool and sent to the memory service.
    admin_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.swap_blocks is not None and self.swap_blocks < 0:
            raise ValueError("swap_blocks must be >= 0")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError("gpu_memory_fraction must be in (0, 1]")
        if not 1 <= self.cuda_graph_max_batch <= MAX_CUDA_GRAPH_BATCH:
            raise ValueError(f"cuda_graph_max_batch must be in [1, {MAX_CUDA_GRAPH_BATCH}]")
        if self.kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be > 0")
