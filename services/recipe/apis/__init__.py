"""Each API's error format (errors.py); conversion lives in convert/, output in emit/."""
