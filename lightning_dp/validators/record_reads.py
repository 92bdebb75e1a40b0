"""Records read by the user's step itself: only the sampled batch may enter a step.

The accounting assumes each record enters step t only through the Poisson sample (probability q). A
``training_step`` that reads the training dataset itself — ``self.trainer.train_dataloader.dataset[i]`` for
negatives, neighbours or a replay buffer — brings records the sampler did not draw into the step, outside that
probability (and unclipped by their own examples' bounds where they act on every gradient). :func:`refuse_record_reads`
watches the training dataset (and the datasets it wraps: ``Subset``, ``ConcatDataset``) while the user's step runs:
its ``__getitem__``/``__getitems__`` are wrapped on their classes for that time only (restored after, so nothing of
it is left between steps), and a read of a watched object is refused when the step returns — before its backward,
hence before its release. The loader's own reads (the sample, fetched by Lightning's loop before the step) and the
checks' (run before the step) are outside the window.

What it cannot see: reads that bypass the dataset's item access (``dataset.tensors[0][i]``), and other copies of the
data (a tensor loaded again from disk).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.validators.kept_state import dataset_parts

_METHODS = ("__getitem__", "__getitems__")


@contextmanager
def refuse_record_reads(dataset: Any) -> Iterator[None]:
    """Run the user's step; refuse, when it returns, if it read records of ``dataset`` or of the datasets it is made
    of (:func:`~.kept_state.dataset_parts`) itself. ``None``: nothing is watched."""
    if dataset is None:
        yield
        return
    watched = dataset_parts(dataset)[0]
    ids = {id(d) for d in watched}
    reads: list[str] = []
    saved: list[tuple[type, str, Any]] = []
    thread = threading.get_ident()
    for cls in {type(d) for d in watched}:
        for name in _METHODS:
            original = getattr(cls, name, None)  # its own or inherited: set on the class itself for the step
            if original is None:
                continue

            def counting(obj: Any, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
                if id(obj) in ids and threading.get_ident() == thread:
                    reads.append(f"{type(obj).__name__}.{_name}({args[0] if args else ''!r})")
                return _original(obj, *args, **kwargs)

            saved.append((cls, name, cls.__dict__.get(name)))
            setattr(cls, name, counting)
    try:
        yield
    finally:
        for cls, name, own in saved:
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)
    if reads:
        raise PrivacyConfigurationError(
            f"training_step read records of the training dataset itself ({', '.join(reads[:3])}"
            f"{' and more' if len(reads) > 3 else ''}): only the Poisson-sampled batch may enter a step, each "
            "record with probability q, which the accounting assumes. Records read besides it (negatives, "
            "neighbours, a replay buffer) enter every step unaccounted for. Nothing was released. Use the batch "
            "the step is handed; take extra examples from public data.")
