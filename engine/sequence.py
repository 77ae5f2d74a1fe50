"""One request's state: its tokens, where its KV lives, and how far it has been computed."""
from __future__ import annotations

import time
from enum import Enum, auto
from itertools import count

from engine.sampling_params import SamplingParams

_seq_ids = count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int,
                 request_id: str | None = None):
        self.seq_id = next(_seq_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.status = SequenceStatus.WAITING
        self.params = params
        self.block_size = block_size
        self.token_ids = list(token_ids)
        self.prompt_token_ids = list(token_ids)      # never changes
        self.completion_token_ids: list[int] = []    # grows with token_ids
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0   # tokens whose K/V are in the cache
        self.num_cached_tokens = 0     # prompt tokens served by the prefix cache at the last admission
        self.num_hashed_blocks = 0     # leading full blocks registered in the prefix cache
        self.block_table: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None  # set when the request failed on its own data
        self.stop_text_len: int | None = None  # text is cut here when a stop string matched
        self.logprobs: list[dict] = []
        self.num_reported_tokens = 0   # completion tokens already handed out by step()
        self.max_num_tokens = len(self.token_ids) + params.max_tokens  # capped by the engine
        self.pending_index = -1        # row of its last token in the launch still sampling it (-1 in token_ids)
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return len(self.completion_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_blocks(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size: (i + 1) * self.block_size]

    @property
    def num_resolved_completion_tokens(self) -> int:
        """Completion tokens whose values are known (a launch in flight leaves a -1 at the end)."""
        ids = self.completion_token_ids
        return len(ids) - 1 if ids and ids[-1] < 0 else len(ids)

    def truncate(self, num_tokens: int) -> None:
        del self.token_ids[num_tokens:]
        del self.completion_token_ids[max(0, num_tokens - self.num_prompt_tokens):]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.completion_token_ids.append(token_id)
