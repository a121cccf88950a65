"""The live dashboard: the page and its assets (page.py, static/), one JSON snapshot of what the
gateway knows (data.py, models.py), the instances' counters (scrape.py) and per-second series
(series.py)."""
