"""The core: one step's gradient accumulated over micro-batches in one ``lax.scan``.

``_types`` and ``_validate`` hold the type aliases and the scalar checks; ``_roles`` the
argument roles' validation; ``_split`` the micro-batch counts and the column-major split and
merge; ``_reduce`` the table of kinds (accumulation dtypes, loss kinds with their divisors,
aux reductions, gradient groups, ``count_across``: a mean over ``D`` shards divides by
``N x D``); ``_stats`` the non-finite test and the squared norm; ``_sharding`` how
accumulators are typed and tied to what they accumulate; ``_info`` the ``AccumInfo``
record; ``_options`` every option validated once, with the public record ``Terms`` (the
data-parallel record ``DataParallel`` is the parallel wing's, ``_parallel/_axes``);
``_outputs`` what ``fun`` returns, checked and taken apart;
``_transform`` the run itself: ``prepare``, the carry table ``CARRY``, ``run_micro_batches``,
``combine_carry``, ``finalize_carry`` and ``accumulate``. A wing plugs in through records:
a micro-batch rule (``_transform.MicroRule``: the per-example wing's) or a cross-device
``combine`` (the parallel wing's). The core imports nothing outside it and its code speaks no
wing's words (``tests/test_architecture.py``).
"""
