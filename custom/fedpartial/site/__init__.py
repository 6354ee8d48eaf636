"""The site command (``fedpartial-site``): what a site's or the server's operator runs on a machine
that has only the runtime wheel and its kit. No FLARE job code lives here."""
