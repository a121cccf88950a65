"""The request's path through the gateway, outermost step first (forward.py lists the steps):
class and pool (classes.py), admission (admission.py), version (versions.py), response cache
(response_cache.py), session placement (sessions.py); what routing reads of a request
(requests.py) and how long a request may wait for capacity (start_wait.py)."""
