#!/bin/sh
# /usr/bin/foretell: starts the Foretell app installed in /opt/foretell (a PyInstaller one-folder bundle).
exec /opt/foretell/foretell "$@"
