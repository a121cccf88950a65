"""The gateway's control plane: the admin API (admin.py), releases driven from a gateway
(releases.py) and the live dashboard (dashboard/)."""
