# No `from __future__ import annotations`: TypedDict reads NotRequired from the annotations.
from typing import Any, NotRequired, TypedDict


class _PromptOptions(TypedDict):
    multi_modal_data: NotRequired[Any]
    media_io_kwargs: NotRequired[Any]
    mm_processor_kwargs: NotRequired[Any]
    multi_modal_uuids: NotRequired[Any]
    cache_salt: NotRequired[str]


class TokensPrompt(_PromptOptions):
    """Schema for a tokenized prompt."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    token_type_ids: NotRequired[list[int]]
    prompt_token_offsets: NotRequired[Any]
