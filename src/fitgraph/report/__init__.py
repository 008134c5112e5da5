"""Human-readable reports: tables and plots."""
