/* Firmware constants and safety loop for the Pika survey rover. */
#include <stdint.h>

#define WATCHDOG_TIMEOUT_MS 250   /* motors stop if the main loop stalls longer than this */
#define MAX_WHEEL_SPEED_MPS 1.4f  /* top speed on flat ground, metres per second */
#define LOW_BATTERY_MV 21000      /* below 21 volts the rover drives back to its dock */

static uint32_t last_kick_ms;

void watchdog_kick(uint32_t now_ms) { last_kick_ms = now_ms; }

int watchdog_expired(uint32_t now_ms) { return now_ms - last_kick_ms > WATCHDOG_TIMEOUT_MS; }

float clamp_speed(float requested) {
    if (requested > MAX_WHEEL_SPEED_MPS) return MAX_WHEEL_SPEED_MPS;
    if (requested < -MAX_WHEEL_SPEED_MPS) return -MAX_WHEEL_SPEED_MPS;
    return requested;
}
