"""A minimal Django site with the dramatiq-guard dashboard mounted under ``/guard/`` (see ``wsgi.py``)."""
