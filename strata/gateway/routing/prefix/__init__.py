"""Which prompt blocks each instance holds, for `--policy cache_aware`: the index (index.py), a
request's prompt as index keys (prompt.py), and the feed of the instances' block events
(feed.py)."""
