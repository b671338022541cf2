"""The object tier's bound on ``capacity`` across every writer on every host, with no server of ours.

Design (docs/operations.md, "Capacity across every writer", says it for operators):

- Every writer keeps a **usage ledger** in the bucket (``sys/use/{writer}``): the records it read or wrote in
  the last `ledger.LEDGER_WINDOW_S`, the newest `ledger.ledger_bound` of them (a few times the records the
  last sweep it knows of left: its size follows what the bucket holds, not the traffic), digest -> unix
  time, access count and parent (`ledger` has the format), and since when it wants to write. One small CBOR
  object rewritten by its owner only (no two writers ever write one object, so no lost update needs a lock). A
  ledger rewritten within ``active_s`` (`active_seconds`) whose owner wants to write names an **active
  writer**.
- One writer at a time **sweeps**: it takes the janitor lock, ``sys/janitor``, by a conditional PUT
  (``If-None-Match: *``: of writers racing for it exactly one succeeds); a lock older than `evictions.LOCK_STALE_S`
  by the server's own clock (a holder killed mid-sweep) is taken over by a PUT ``If-Match`` its ETag (again
  exactly one wins). The holder reads every ledger (the active writers, and per record a last use, the
  newest of its write and the reads, an access count and a parent), then lists the records (at
  ``listed_at``), and gives each active writer a **grant**: bytes it may write after ``listed_at``,
  ``sweep_share`` of capacity (at least two of the largest records listed; at most `MAX_RESERVE` of capacity
  for all grants together). It deletes records in the order of ``policy`` (`order`: ``prefix``, the default,
  LRFU keys with no parent before its children; ``lru``, last use) until usage is at most ``capacity`` minus
  the grants (the **low-water mark**), counting for each writer the larger of its new and its previous grant
  (a writer may not have learned the new one yet). Records of pinned tags are skipped, up to ``pin_budget``
  of capacity, while unpinned records remain (as the disk tier does); their tags come from a HEAD of each
  candidate. The result, with the grants, ``listed_at`` and the half-life it ranked by (writers decay their
  ledgers' counts by it), goes to ``sys/usage``, which every writer reads. Ledgers not rewritten within
  `ledger.LEDGER_WINDOW_S` (a writer gone) are deleted.
- A writer **admits** a record only within its grant: the bytes it wrote after the ``listed_at`` of the last
  sweep it knows of (its writes before then were listed), plus those admitted and not yet written, plus
  the record, at most its grant. Past half of it, its janitor sweeps (or learns of another's sweep, which
  resets the count); with no room left, the put waits for a sweep, up to `ADMIT_WAIT_TIMEOUTS` x
  ``timeout_s``. A writer with no grant (new, or idle until its ledger grew stale) waits so for a sweep
  that saw its ledger to grant it one.
- When no sweep came within that wait (the lock held by a sweeper that died or hangs, until `LOCK_STALE_S`;
  a store that was away, or is too loaded to list in time), the writer **falls back** to the bound this
  tier had before grants: it writes up to `FALLBACK_SHARES` x ``sweep_share`` of capacity since the last
  sweep it knows of (or its grant, if larger), without waiting again until a sweep comes, and warns once.
  Past that, puts are dropped (counted). Why not drop everything meanwhile: the serving test saw a server
  whose janitor lock outlived a SIGSTOP of the store, and a precompute job on a loaded machine, drop every
  write for minutes; usage passing capacity by a few percent for as long costs far less.

Why that bounds usage: after a sweep, usage is at most the low-water mark plus what every active writer wrote
after ``listed_at``, and each wrote at most the larger of its two last grants, which the low-water mark left
room for: so usage stays at most ``capacity``, at every instant, while sweeps are as slow as they are, and
sweeps do come (the fallback above loosens it to ``capacity`` + writers x `FALLBACK_SHARES` x ``sweep_share``
of capacity while they do not). What it leaves approximate: clocks (a writer compares its own write times with
the sweeper's ``listed_at``: a skew of s seconds between hosts lets s seconds of writes through unaccounted;
NTP keeps it at milliseconds), deletes that fail (the next sweep retries them), a writer whose grant shrank
(more writers arrived) before it learned of the new one, and a put still in flight when its writer's ledger
grew stale (``active_s``/2 after its last rewrite, far longer than a put). `tiercache bench capacity` measures
the peak.

What it costs: usage runs between the low-water mark and ``capacity`` (with 4 writers and the default
``sweep_share`` 0.02, from 92% to 100%); a sweep every half grant a writer writes; and a new writer's first
put waits for one sweep (at most `ADMIT_WAIT_TIMEOUTS` x ``timeout_s``). Why not a usage counter every writer
updates (conditional PUT on one object): every put would be a read-modify-write round trip on one hot object,
serialised across hosts. Why not the store's Redis: there may be none, and the bucket must stay consistent
alone. Why not a bucket lifecycle rule alone: it expires by age, not by use or bytes; where records are
written once and read for a fixed time (a corpus refreshed daily), a lifecycle rule on ``{prefix}r/`` is
cheaper than sweeping and can replace it (capacity then only reports). The price of this design: a sweep lists
every record (1,000 per request, about 10,000 requests for 10 million records), so its cost grows with the
record count; ``sweep_share`` (bytes written between sweeps) and ``sweep_every_s`` trade that against how far
below capacity the low-water mark sits.
"""
