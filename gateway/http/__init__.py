"""The gateway's OpenAI-compatible HTTP API, served beside gRPC on the same
engine and event loop (FastAPI + uvicorn, as vLLM does).

* ``server.py``   HttpServer: uvicorn on the gateway's running loop; HttpConfig
* ``app.py``      the routes: /v1/models, /v1/completions, /v1/chat/completions,
                  /tokenize, /detokenize, /health, /metrics, /version
* ``protocol.py`` request bodies -> typed requests (gateway.params' RawParams)
* ``render.py``   responses, stream chunks, logprobs, usage
* ``streams.py``  SSE and deferred responses that abort on a client disconnect
* ``chat.py``     the chat template
* ``errors.py``   domain errors -> OpenAI-shaped errors with HTTP statuses

Admission is ``gateway.frontend``'s, shared with the gRPC servicer: the same
validation, the same messages. Nothing here imports grpc. docs/api.md is the
reference.
"""
