"""WSGI entry point: ``gunicorn -c deploy/gunicorn.conf.py gateway.wsgi:app``."""
from gateway import create_app

app = create_app()
