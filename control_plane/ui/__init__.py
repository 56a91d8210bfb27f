"""The dashboard (/ui): server-rendered pages (Jinja2) refreshed in place by htmx (vendored under
control_plane/static/htmx); routes in control_plane/api/ui.py, read models in
control_plane/services/read/dashboard.py. No build step, no CDN."""
