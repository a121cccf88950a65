"""Talking to instances: the proxy (proxy.py) sends each attempt (attempt.py) over per-instance
connection pools (pools.py, a lean HTTP/1.1 client in connection.py and answer.py), retries
before the first byte within a budget (retry.py), resumes broken streams (resume.py) and fails
dead sockets fast (stalls.py)."""
