"""/v1/embeddings: one vector per input (the engine's mean-pooled, normalised hidden states,
engine/embedding.py), computed on the engine thread like any other job, in the same queue.

A chat model's pooled hidden states are not a trained embedding model's: they serve editor
context search (llama.vscode, Continue's indexing) as llama.cpp's `--embeddings` does with the
same kind of model, and say nothing better than that.
"""

from __future__ import annotations

import base64
import uuid
from typing import Annotated, Literal, cast

import numpy as np
from pydantic import Field

from engine.types import GenerationRequest
from server.bridge import Job
from server.errors import APIError
from server.planning import Planner
from server.schemas import StrictModel, WholeNumber

MAX_INPUTS = 2048  # OpenAI's limit per request

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingsRequest(StrictModel):
    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, WholeNumber, Field(ge=1)] | None = None
    user: str | None = None


def plan_embeddings(planner: Planner, body: EmbeddingsRequest) -> list[GenerationRequest]:
    raw = body.input
    inputs = raw if isinstance(raw, list) and raw and isinstance(raw[0], (str, list)) else [raw]
    if not inputs or len(inputs) > MAX_INPUTS:
        raise APIError(f"input must hold 1 to {MAX_INPUTS} items, got {len(inputs)}", param="input")
    hidden = planner.engine.model.args.hidden_size
    if body.dimensions is not None and body.dimensions != hidden:
        raise APIError(f"this model's embeddings have {hidden} dimensions; dimensions {body.dimensions} cannot be "
                       "given (it has no shortened embeddings)", param="dimensions")
    requests = []
    context = planner.engine.config.max_context
    for i, item in enumerate(inputs):
        param = "input" if len(inputs) == 1 else f"input[{i}]"
        if len(item) == 0:
            raise APIError(f"{param} is empty", param=param)
        ids = planner.text_ids(item, param) if isinstance(item, str) else \
            planner.checked_ids(cast(list[int], item), param)
        if len(ids) >= context:
            raise APIError(f"{param} has {len(ids)} tokens; the context holds {context}", param=param,
                           code="context_length_exceeded")
        requests.append(GenerationRequest(prompt_ids=ids, request_id=uuid.uuid4().hex, embed=True))
    return requests


async def embeddings_answer(job: Job, model: str, encoding: str | None) -> dict:
    data, tokens = [], 0
    for index, _ in enumerate(job.requests):
        step = await job.next_step()
        if step.embedding is None:  # cancelled before it ran
            raise APIError("the request was cancelled", status=499)
        tokens += step.stats.prompt_tokens if step.stats else 0
        vector: list[float] | str = step.embedding
        if encoding == "base64":
            vector = base64.b64encode(np.asarray(step.embedding, dtype="<f4").tobytes()).decode("ascii")
        data.append({"object": "embedding", "index": index, "embedding": vector})
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
