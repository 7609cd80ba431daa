"""The batch-time model's calibration: eq. 12's β, θ of eq. 8, TPOT and throughput, fitted from
``bear.batch/1`` records — offline from files and online (``bear calibrator``) from NATS."""
