"""The example site's own pages (one): the dashboard is mounted beside Django, in ``wsgi.py``."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.urls import path


def home(request: HttpRequest) -> HttpResponse:
    return HttpResponse("The site's own page.")


urlpatterns = [path("", home)]
