"""nn.Modules and model loading only: no training logic lives here."""
