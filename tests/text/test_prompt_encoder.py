"""The prompt encoder (the gateway's and the router's): a model's tokenizer is loaded once, however many requests
ask for it at once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from services.base import protocol as p
from services.text.prompt_encoder import PromptEncoder


class _CountingEncoder(PromptEncoder):
    def __init__(self):
        super().__init__()
        self.loads, self._count = 0, threading.Lock()

    def _load(self, model_dir: str):
        with self._count:
            self.loads += 1
        time.sleep(0.2)  # a real load takes seconds: the burst's other requests arrive meanwhile
        return PromptEncoder._load(model_dir)


def test_a_burst_of_first_requests_loads_the_tokenizer_once(make_checkpoint):
    encoder, model_dir = _CountingEncoder(), str(make_checkpoint("llama"))
    request = p.GenerateRequest(request_id="r", kind="completion", model="m", prompt="hello there",
                                sampling=p.SamplingOptions())
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda _: encoder.prompt_ids(request.model_copy(deep=True), "m", model_dir), range(8)))
    assert encoder.loads == 1 and all(i == ids[0] and i for i in ids)
