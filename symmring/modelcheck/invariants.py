"""The five ring invariants the model checker checks (docs/MODELCHECK.md section 2), each by the name a
violation reports."""

INV_EXACT_READ = "inv1-exact-read"  #: a consumer read sees the tag of exactly the chunk it expects
INV_REUSE = "inv2-reuse-after-all-acks"  #: a slot is overwritten only after every required ack arrived
INV_NO_STALE_WAIT = "inv3-no-stale-wait"  #: a satisfied wait had the awaited chunk's route+layout published
INV_COMBINE_ONCE = "inv4-combine-exactly-once"  #: each (source, call, chunk, consumer) result written once
INV_LIVENESS = "inv5-no-deadlock"  #: every terminal state is the complete one

INVARIANTS = (INV_EXACT_READ, INV_REUSE, INV_NO_STALE_WAIT, INV_COMBINE_ONCE, INV_LIVENESS)
