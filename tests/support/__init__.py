"""What chkq's tests share: fixtures (``plugins``), run builders and independent checks."""
