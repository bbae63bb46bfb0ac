"""ferry.parallel: expert parallelism across the ranks of one worker group.

placement / eplb are pure (no torch): which rank holds which expert, and how to re-place hot ones.
shard turns a loaded model into one rank's share; lockstep steps the ranks' engines together;
overlap runs a step as two micro-batches whose all-to-all hides behind the other's compute.
"""
