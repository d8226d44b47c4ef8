"""The HTTP API's server: uvicorn on the gateway's own event loop
(``kvpager.asgi.AsgiServer``), configured by ``HttpConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpager.asgi import AsgiServer


@dataclass
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000                        # 0: any free port
    served_model_name: str = ""             # default: the checkpoint directory's name
    chat_template: str | None = None        # a Jinja file overriding the tokenizer's template
    api_key: str | None = field(default=None, repr=False)  # required bearer token (besides the gateway token)
    keep_alive_s: float = 30.0


class HttpServer(AsgiServer):
    def __init__(self, config: HttpConfig, app, *, tls=None, grace_s: float = 5.0) -> None:
        super().__init__(config.host, config.port, app, tls=tls, grace_s=grace_s, keep_alive_s=config.keep_alive_s,
                         name="openai")
        self.config = config
