"""Jinja2 templates of generated Triton source (installed as the package `attngen.templates`)."""
