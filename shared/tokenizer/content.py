"""The content tokenizer: the only way untrusted text becomes token ids (INJ-01).

A model's tokenizer matches its added tokens (`<|im_end|>`, `<｜User｜>`, ...) anywhere in the
text it is given, so a user who types a marker gets the control id. `encode_special_tokens`
(HF's `split_special_tokens`) turns that matching off only for tokens flagged `special`, and
DeepSeek-V3 flags its chat and tool markers `special: false` (docs/design.md, 'Tokenization'):
with it alone `<｜User｜>` in content still becomes 128803. So this is a copy of the model's
tokenizer (round-tripped through `to_str()`, the original is untouched) in which every added
token is flagged special and `encode_special_tokens` is on: a marker in content is then
ordinary text, split by the pre-tokenizer like any other punctuation, and no added-token id
can come out.

For benign text (no added-token string in it) the ids are the model tokenizer's own, so a
prompt built from content segments hits the same prefix-cache blocks (INJ-07). Segments are
encoded with `add_special_tokens=False`: BOS comes from the template skeleton once (PC-05).

Every encode is checked against `forbidden_ids` anyway: a vocabulary whose BPE could spell an
added token's id from plain bytes would otherwise fail silently. The check is a set
intersection, about 1 ms per 77K ids, paid only on cache misses.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer


class ContentLeakError(RuntimeError):
    """The content tokenizer produced an added-token id: a vocabulary this design cannot
    protect. Raised instead of returning ids that would carry a control token."""


class ContentTokenizer:
    """Encodes untrusted text so it can never yield an added-token id (special or not), nor
    BOS/EOS. Thread-safe: `tokenizers.Tokenizer` encodes are reentrant."""

    def __init__(self, tokenizer: Tokenizer, *, extra_forbidden_ids: Iterable[int] = ()) -> None:
        """`extra_forbidden_ids`: BOS/EOS ids of a vocabulary where they are not added tokens
        (in the served models and DeepSeek-V3 they are, so the default suffices)."""
        raw = json.loads(tokenizer.to_str())
        forbidden = set(extra_forbidden_ids)
        for added in raw.get("added_tokens", []):
            added["special"] = True
            forbidden.add(int(added["id"]))
        content = Tokenizer.from_str(json.dumps(raw))
        content.encode_special_tokens = True
        # The post-processor would add BOS/EOS only with add_special_tokens=True, which this
        # class never passes; dropping it anyway makes that impossible to get wrong.
        content.post_processor = None
        self._tokenizer = content
        self.forbidden_ids: frozenset[int] = frozenset(forbidden)

    def encode(self, text: str) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        self._check(ids)
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many texts in one call: the Rust side encodes them in parallel, without the GIL."""
        if not texts:
            return []
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        batch = [encoding.ids for encoding in encodings]
        for ids in batch:
            self._check(ids)
        return batch

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def _check(self, ids: list[int]) -> None:
        if not self.forbidden_ids.isdisjoint(ids):
            leaked = sorted(self.forbidden_ids.intersection(ids))
            raise ContentLeakError(f"content tokenization produced added-token ids {leaked}")
